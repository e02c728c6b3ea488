//! The admin commands: each parses its flags into a request, calls the control plane, and
//! prints the answer as a table or JSON.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, anyhow};
use clap::{Args, Subcommand};
use serde_json::Value;
use switchyard_proto::v1 as pb;
use switchyard_proto::v1::admin_client::AdminClient;
use switchyard_shared::{
    EndpointConfig, EndpointConfigName, HealthCheckConfig, InstanceProtocol, InstanceRole,
    ValidationError, sagemaker,
};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::import::{self, ImportArgs, ImportError};
use crate::output::{self, OutputFormat};

/// How to reach the control plane (global flags).
#[derive(Debug, Clone, Args)]
pub struct Connection {
    /// Control-plane gRPC URL.
    #[arg(
        long,
        global = true,
        env = "SWITCHYARD_CONTROL_PLANE",
        default_value = "http://127.0.0.1:50051"
    )]
    pub control_plane: String,
    /// File holding the admin bearer token (also $SWITCHYARD_ADMIN_TOKEN).
    #[arg(long, global = true)]
    pub admin_token_file: Option<PathBuf>,
    /// PEM CA certificate to trust for an https:// control plane.
    #[arg(long, global = true)]
    pub tls_ca: Option<PathBuf>,
    /// Output format.
    #[arg(long, global = true, value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
}

#[derive(Debug, Clone)]
pub struct BearerToken(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for BearerToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", token.clone());
        }
        Ok(request)
    }
}

pub type Client = AdminClient<InterceptedService<Channel, BearerToken>>;

/// A failure the user caused (bad flag, bad JSON): exit 64.
pub use switchyard_process::UsageError;

impl Connection {
    pub async fn connect(&self) -> anyhow::Result<Client> {
        let token = match &self.admin_token_file {
            Some(path) => Some(switchyard_process::read_token_file(
                path,
                "--admin-token-file",
            )?),
            None => std::env::var("SWITCHYARD_ADMIN_TOKEN").ok(),
        };
        let token = match token {
            Some(token) => Some(format!("Bearer {token}").parse().map_err(|_| {
                UsageError("the admin token has characters a header cannot carry".into())
            })?),
            None => None,
        };
        let mut endpoint = Channel::from_shared(self.control_plane.clone())
            .map_err(|err| UsageError(format!("--control-plane {:?}: {err}", self.control_plane)))?
            .connect_timeout(Duration::from_secs(5))
            .timeout(Duration::from_secs(30));
        if let Some(ca) = &self.tls_ca {
            let pem = std::fs::read(ca)
                .map_err(|err| UsageError(format!("--tls-ca {}: {err}", ca.display())))?;
            endpoint = endpoint
                .tls_config(
                    tonic::transport::ClientTlsConfig::new()
                        .ca_certificate(tonic::transport::Certificate::from_pem(pem)),
                )
                .map_err(|err| UsageError(format!("--tls-ca: {err}")))?;
        }
        let channel = endpoint.connect().await.with_context(|| {
            format!(
                "cannot reach the control plane at {} (is switchyard-control running? set --control-plane or SWITCHYARD_CONTROL_PLANE)",
                self.control_plane
            )
        })?;
        Ok(AdminClient::with_interceptor(channel, BearerToken(token)))
    }
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Create an endpoint config from SageMaker's ProductionVariants JSON.
    Create {
        #[arg(long)]
        name: String,
        /// The JSON of `aws sagemaker create-endpoint-config --production-variants`, or
        /// file://PATH to read it from a file.
        #[arg(long)]
        production_variants: String,
        /// Path probed on every instance (vLLM: /health).
        #[arg(long, default_value = "/health")]
        health_check_path: String,
        /// Milliseconds between probes of one instance.
        #[arg(long, default_value_t = 1000)]
        health_check_interval_ms: u32,
        /// Consecutive failed probes before an instance stops receiving traffic.
        #[arg(long, default_value_t = 3)]
        unhealthy_threshold: u32,
        /// Disaggregated prefill/decode, as JSON (or file://PATH): {"PrefillVariantName",
        /// "DecodeVariantName", "RouteThreshold" (tokens, default 4096),
        /// "PrefillRoutingStrategy" (ROUND_ROBIN default, PREFIX_AWARE, KV_AWARE: the prefill
        /// instance holding most of the prompt by its KV events, SESSION),
        /// "DecodeRoutingStrategy" (LEAST_OUTSTANDING_REQUESTS default, RANDOM, PREFIX_AWARE),
        /// "ThresholdBasis" (PROMPT_TOKENS default; UNCACHED_TOKENS: the prompt tokens the
        /// first-choice decoder does not hold, by its KV events), "KvTransferProtocol" (NIXL
        /// default, LMCACHE), "Tokenizer" (cl100k_base default, o200k_base, or a tokenizer.json
        /// name under the routers' --tokenizer-dir), "PrefillTimeoutSeconds" (default 120)}.
        /// KV_AWARE and UNCACHED_TOKENS read the KV events of the pool's instances (registered
        /// with --kv-events) and the engines' /tokenize; without them they route by load and
        /// count every prompt token as uncached.
        #[arg(long)]
        disaggregation_config: Option<String>,
    },
    /// Show one endpoint config.
    Describe {
        #[arg(long)]
        name: String,
    },
    /// List endpoint configs.
    List,
    /// Delete an endpoint config no endpoint uses.
    Delete {
        #[arg(long)]
        name: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum EndpointCommand {
    /// Create an endpoint that serves an endpoint config.
    Create {
        #[arg(long)]
        name: String,
        #[arg(long)]
        endpoint_config_name: String,
    },
    /// Switch an endpoint to another config (no request is dropped).
    Update {
        #[arg(long)]
        name: String,
        #[arg(long)]
        endpoint_config_name: String,
    },
    /// Show one endpoint.
    Describe {
        #[arg(long)]
        name: String,
    },
    /// List endpoints.
    List,
    /// Delete an endpoint and its instance registrations.
    Delete {
        #[arg(long)]
        name: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum InstanceCommand {
    /// Register an inference server as an instance of an endpoint's variant.
    Register(Box<RegisterArgs>),
    /// Remove an instance.
    Deregister {
        #[arg(long)]
        endpoint: String,
        #[arg(long)]
        id: String,
    },
    /// List instances with their health.
    List {
        #[arg(long)]
        endpoint: Option<String>,
    },
    /// Register many instances from a file of JSON lines, in batched transactions; nothing is
    /// imported if any line is refused. For moving a fleet in.
    Import(ImportArgs),
    /// Renew the lease of an instance registered with --ttl (for scripts and agents).
    Heartbeat {
        #[arg(long)]
        endpoint: String,
        #[arg(long)]
        id: String,
    },
}

#[derive(Debug, Args)]
pub struct RegisterArgs {
    #[arg(long)]
    pub endpoint: String,
    #[arg(long)]
    pub variant: String,
    /// Base URL of the server, e.g. http://10.0.0.7:8000
    #[arg(long)]
    pub url: String,
    /// Instance id; default: VARIANT-<random>.
    #[arg(long)]
    pub id: Option<String>,
    #[arg(long, default_value = "both")]
    pub role: InstanceRole,
    /// How routers talk to it: http1 (HTTP/1.1 keep-alive, what vLLM serves) or h2c (HTTP/2
    /// without TLS). Default: each router's --upstream-protocol.
    #[arg(long)]
    pub protocol: Option<InstanceProtocol>,
    /// Relative share of traffic within the variant.
    #[arg(long)]
    pub weight: Option<f64>,
    /// Lease TTL in seconds. Without it the instance stays until deregistered. With it, this
    /// command keeps running and heartbeats every TTL/3 until interrupted, then deregisters
    /// (unless --detach).
    #[arg(long)]
    pub ttl: Option<u32>,
    /// With --ttl: register and exit; heartbeats are then up to you (`instance heartbeat`).
    #[arg(long, requires = "ttl")]
    pub detach: bool,
    /// The engine's KV-cache event publisher (vLLM's --kv-events-config "endpoint", ZMQ PUB),
    /// as routers reach it: tcp://HOST:PORT. KV_AWARE variants route from these events, and
    /// so do a disaggregated endpoint's KV_AWARE prefill pool and UNCACHED_TOKENS decoders.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    pub kv_events: Option<String>,
    /// The engine's KV-event replay socket (vLLM's "replay_endpoint", ZMQ ROUTER):
    /// tcp://HOST:PORT. Lets routers repair missed events; needs --kv-events.
    #[arg(long, value_name = "tcp://HOST:PORT", requires = "kv_events")]
    pub kv_events_replay: Option<String>,
    /// A data-parallel engine (vLLM's --data-parallel-size N): its N ranks publish on the
    /// --kv-events port + rank (replay: the --kv-events-replay port + rank); routers follow
    /// each rank and send a request to the rank holding its prefix (vLLM's
    /// X-data-parallel-rank header). Needs --kv-events. Default 1.
    #[arg(long, value_name = "N", requires = "kv_events")]
    pub kv_events_data_parallel_size: Option<u32>,
    /// LMCACHE disaggregation: the InstanceId of the decode instance this prefill instance
    /// pushes its KV cache to (the decoder its LMCache config names).
    #[arg(long, value_name = "ID")]
    pub decode_partner: Option<String>,
    /// LMCACHE_PD disaggregation, on a decode instance: the host prefill engines reach its
    /// LMCache PD receiver at (its LMCache config's pd_peer_host).
    #[arg(long, value_name = "HOST")]
    pub lmcache_receiver_host: Option<String>,
    /// Its init ports, one per tensor-parallel rank (pd_peer_init_port), comma-separated.
    #[arg(
        long,
        value_name = "PORT,...",
        value_delimiter = ',',
        requires = "lmcache_receiver_host"
    )]
    pub lmcache_receiver_init_ports: Vec<u16>,
    /// Its alloc ports, one per tensor-parallel rank (pd_peer_alloc_port), comma-separated.
    #[arg(
        long,
        value_name = "PORT,...",
        value_delimiter = ',',
        requires = "lmcache_receiver_host"
    )]
    pub lmcache_receiver_alloc_ports: Vec<u16>,
    /// Prompt tokens its PD buffer holds (pd_buffer_size / KV bytes per token): each router
    /// keeps its hand-offs in flight to it within this. Default: no cap.
    #[arg(long, value_name = "TOKENS", requires = "lmcache_receiver_host")]
    pub lmcache_receiver_buffer_tokens: Option<u32>,
}

fn print_value(format: OutputFormat, value: Value, table: impl FnOnce() -> String) {
    match format {
        OutputFormat::Json => println!(
            "{}",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        ),
        OutputFormat::Table => print!("{}", table()),
    }
}

/// An object the control plane answered with, as a domain type.
fn read<W, T: TryFrom<W, Error = ValidationError>>(wire: W) -> anyhow::Result<T> {
    T::try_from(wire).map_err(|err| anyhow!("unreadable answer: {err}"))
}

/// Prints an object the control plane answered with: its JSON, or `table` of it; returns it.
fn print_answer<W, T: TryFrom<W, Error = ValidationError>>(
    format: OutputFormat,
    answer: W,
    json: fn(&T) -> Value,
    table: impl FnOnce(&T) -> String,
) -> anyhow::Result<T> {
    let answer = read(answer)?;
    print_value(format, json(&answer), || table(&answer));
    Ok(answer)
}

/// Prints an object the control plane described: its JSON, or its table.
fn print_found<W, T: TryFrom<W, Error = ValidationError>>(
    format: OutputFormat,
    found: W,
    json: fn(&T) -> Value,
    rows: fn(&[T]) -> String,
) -> anyhow::Result<()> {
    print_answer(format, found, json, |found| {
        rows(std::slice::from_ref(found))
    })?;
    Ok(())
}

/// Prints the objects the control plane listed: a JSON array, or a table.
fn print_listed<W, T: TryFrom<W, Error = ValidationError>>(
    format: OutputFormat,
    listed: Vec<W>,
    json: fn(&T) -> Value,
    rows: fn(&[T]) -> String,
) -> anyhow::Result<()> {
    let listed = listed
        .into_iter()
        .map(read)
        .collect::<anyhow::Result<Vec<T>>>()?;
    print_value(
        format,
        Value::Array(listed.iter().map(json).collect()),
        || rows(&listed),
    );
    Ok(())
}

/// Prints that the `kind` called `name` is gone.
fn print_deleted(format: OutputFormat, kind: &str, name: &str) {
    print_value(format, serde_json::json!({"Deleted": name}), || {
        format!("deleted {kind} {name}\n")
    });
}

/// A JSON argument of `flag`, or with file://PATH the text of that file.
fn json_argument(flag: &str, argument: String) -> Result<String, UsageError> {
    match argument.strip_prefix("file://") {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|err| UsageError(format!("{flag} file://{path}: {err}"))),
        None => Ok(argument),
    }
}

pub async fn endpoint_config(
    connection: &Connection,
    command: ConfigCommand,
) -> anyhow::Result<()> {
    let format = connection.output;
    match command {
        ConfigCommand::Create {
            name,
            production_variants,
            health_check_path,
            health_check_interval_ms,
            unhealthy_threshold,
            disaggregation_config,
        } => {
            let json = json_argument("--production-variants", production_variants)?;
            let disaggregation_config = disaggregation_config
                .map(|argument| {
                    let json = json_argument("--disaggregation-config", argument)?;
                    sagemaker::parse_disaggregation_config(&json)
                        .map_err(|err| UsageError(format!("--disaggregation-config: {err}")))
                })
                .transpose()?;
            let parsed = sagemaker::parse_production_variants(&json)
                .map_err(|err| UsageError(format!("--production-variants: {err}")))?;
            for field in &parsed.ignored_fields {
                eprintln!("warning: {field} is a SageMaker setting Switchyard ignores");
            }
            let config = EndpointConfig {
                endpoint_config_name: EndpointConfigName::new(&name)
                    .map_err(|err| UsageError(format!("--name: {err}")))?,
                production_variants: parsed.variants,
                health_check_config: HealthCheckConfig {
                    path: health_check_path,
                    interval_ms: health_check_interval_ms,
                    unhealthy_threshold,
                    ..HealthCheckConfig::default()
                },
                creation_time_ms: 0,
                disaggregation_config,
            };
            // Check locally first for a quick answer; the control plane checks again.
            config
                .validate()
                .map_err(|err| UsageError(err.to_string()))?;
            let created = connection
                .connect()
                .await?
                .create_endpoint_config(pb::CreateEndpointConfigRequest {
                    endpoint_config: Some((&config).into()),
                })
                .await?
                .into_inner();
            print_answer(format, created, output::config_json, |created| {
                format!("created endpoint config {}\n", created.endpoint_config_name)
            })?;
        }
        ConfigCommand::Describe { name } => {
            let found = connection
                .connect()
                .await?
                .describe_endpoint_config(pb::DescribeEndpointConfigRequest { name })
                .await?
                .into_inner();
            print_found(format, found, output::config_json, output::config_rows)?;
        }
        ConfigCommand::List => {
            let listed = connection
                .connect()
                .await?
                .list_endpoint_configs(pb::ListEndpointConfigsRequest {})
                .await?
                .into_inner()
                .endpoint_configs;
            print_listed(format, listed, output::config_json, output::config_rows)?;
        }
        ConfigCommand::Delete { name } => {
            connection
                .connect()
                .await?
                .delete_endpoint_config(pb::DeleteEndpointConfigRequest { name: name.clone() })
                .await?;
            print_deleted(format, "endpoint config", &name);
        }
    }
    Ok(())
}

pub async fn endpoint_command(
    connection: &Connection,
    command: EndpointCommand,
) -> anyhow::Result<()> {
    let format = connection.output;
    let mut client = connection.connect().await?;
    match command {
        EndpointCommand::Create {
            name,
            endpoint_config_name,
        } => {
            let created = client
                .create_endpoint(pb::CreateEndpointRequest {
                    name,
                    endpoint_config_name,
                })
                .await?
                .into_inner();
            print_answer(format, created, output::endpoint_json, |created| {
                format!(
                    "created endpoint {} ({})\n",
                    created.endpoint_name, created.endpoint_status
                )
            })?;
        }
        EndpointCommand::Update {
            name,
            endpoint_config_name,
        } => {
            let updated = client
                .update_endpoint(pb::UpdateEndpointRequest {
                    name,
                    endpoint_config_name,
                })
                .await?
                .into_inner();
            print_answer(format, updated, output::endpoint_json, |updated| {
                format!(
                    "endpoint {} now uses config {}\n",
                    updated.endpoint_name, updated.endpoint_config_name
                )
            })?;
        }
        EndpointCommand::Describe { name } => {
            let found = client
                .describe_endpoint(pb::DescribeEndpointRequest { name })
                .await?
                .into_inner();
            print_found(format, found, output::endpoint_json, output::endpoint_rows)?;
        }
        EndpointCommand::List => {
            let listed = client
                .list_endpoints(pb::ListEndpointsRequest {})
                .await?
                .into_inner()
                .endpoints;
            print_listed(format, listed, output::endpoint_json, output::endpoint_rows)?;
        }
        EndpointCommand::Delete { name } => {
            client
                .delete_endpoint(pb::DeleteEndpointRequest { name: name.clone() })
                .await?;
            print_deleted(format, "endpoint", &name);
        }
    }
    Ok(())
}

pub async fn instance_command(
    connection: &Connection,
    command: InstanceCommand,
) -> anyhow::Result<()> {
    let format = connection.output;
    let mut client = connection.connect().await?;
    match command {
        InstanceCommand::Register(args) => register(&mut client, format, *args).await?,
        InstanceCommand::Import(args) => {
            import::import(format, args, |request| client.import_instances(request))
                .await
                .map_err(|err| match err {
                    ImportError::ControlPlane(status) => anyhow::Error::new(status),
                    usage => UsageError(usage.to_string()).into(),
                })?
        }
        InstanceCommand::Deregister { endpoint, id } => {
            client
                .deregister_instance(pb::DeregisterInstanceRequest {
                    endpoint_name: endpoint.clone(),
                    id: id.clone(),
                })
                .await?;
            print_value(
                format,
                serde_json::json!({"Deregistered": id, "EndpointName": endpoint}),
                || format!("deregistered instance {id} of endpoint {endpoint}\n"),
            );
        }
        InstanceCommand::List { endpoint } => {
            let listed = client
                .list_instances(pb::ListInstancesRequest {
                    endpoint_name: endpoint.unwrap_or_default(),
                })
                .await?
                .into_inner()
                .instances;
            print_listed(format, listed, output::instance_json, output::instance_rows)?;
        }
        InstanceCommand::Heartbeat { endpoint, id } => {
            let response = client
                .heartbeat(pb::HeartbeatRequest {
                    endpoint_name: endpoint,
                    id: id.clone(),
                })
                .await?
                .into_inner();
            print_value(
                format,
                serde_json::json!({"InstanceId": id, "TtlSeconds": response.ttl_seconds}),
                || format!("renewed instance {id} for {}s\n", response.ttl_seconds),
            );
        }
    }
    Ok(())
}

async fn register(
    client: &mut Client,
    format: OutputFormat,
    args: RegisterArgs,
) -> anyhow::Result<()> {
    // Checked here for a quick exit 64; the control plane checks again.
    let kv_events = switchyard_shared::KvEventsEndpoints::parse(
        args.kv_events.as_deref(),
        args.kv_events_replay.as_deref(),
        args.kv_events_data_parallel_size,
        switchyard_shared::KvEventsFields {
            publisher: "--kv-events",
            replay: "--kv-events-replay",
            data_parallel_size: "--kv-events-data-parallel-size",
        },
    )
    .map_err(|err| UsageError(err.to_string()))?;
    let lmcache_receiver = switchyard_shared::LmcacheReceiver::parse(
        args.lmcache_receiver_host.as_deref(),
        Some(args.lmcache_receiver_init_ports.clone()),
        Some(args.lmcache_receiver_alloc_ports.clone()),
        args.lmcache_receiver_buffer_tokens,
        [
            "--lmcache-receiver-host",
            "--lmcache-receiver-init-ports",
            "--lmcache-receiver-alloc-ports",
            "--lmcache-receiver-buffer-tokens",
        ],
    )
    .map_err(|err| UsageError(err.to_string()))?;
    let registered = client
        .register_instance(pb::RegisterInstanceRequest {
            endpoint_name: args.endpoint.clone(),
            variant_name: args.variant,
            url: args.url,
            id: args.id.unwrap_or_default(),
            role: pb::InstanceRole::from(args.role) as i32,
            protocol: pb::InstanceProtocol::from(args.protocol.unwrap_or_default()) as i32,
            weight: args.weight,
            ttl_seconds: args.ttl.unwrap_or(0),
            kv_events_endpoint: kv_events
                .as_ref()
                .map(|kv| kv.publisher.clone())
                .unwrap_or_default(),
            kv_events_data_parallel_size: kv_events.as_ref().map_or(0, |kv| kv.data_parallel_size),
            kv_events_replay_endpoint: kv_events.and_then(|kv| kv.replay).unwrap_or_default(),
            decode_partner: args.decode_partner.unwrap_or_default(),
            lmcache_receiver: lmcache_receiver
                .as_ref()
                .map(switchyard_proto::convert::lmcache_receiver_message),
        })
        .await?
        .into_inner();
    let registered = print_answer(format, registered, output::instance_json, |registered| {
        format!(
            "registered instance {} of endpoint {} at {}\n",
            registered.instance_id, registered.endpoint_name, registered.url
        )
    })?;
    let Some(ttl) = args.ttl.filter(|ttl| *ttl > 0) else {
        return Ok(());
    };
    if args.detach {
        return Ok(());
    }
    let id = registered.instance_id.to_string();
    let period = Duration::from_millis(u64::from(ttl) * 1000 / 3);
    eprintln!("heartbeating every {period:?}; Ctrl-C deregisters and exits");
    let stop = switchyard_process::shutdown_signal();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            () = &mut stop => break,
            () = tokio::time::sleep(period) => {}
        }
        let beat = client
            .heartbeat(pb::HeartbeatRequest {
                endpoint_name: args.endpoint.clone(),
                id: id.clone(),
            })
            .await;
        if let Err(status) = beat {
            eprintln!("warning: heartbeat failed: {}", status.message());
            if status.code() == tonic::Code::NotFound {
                return Err(anyhow!(
                    "instance {id} lost its lease: {}",
                    status.message()
                ));
            }
        }
    }
    client
        .deregister_instance(pb::DeregisterInstanceRequest {
            endpoint_name: args.endpoint,
            id: id.clone(),
        })
        .await?;
    eprintln!("deregistered instance {id}");
    Ok(())
}
