//! `switchyard up`: a whole local cluster in one command: the control plane on an embedded
//! store, routers, and simulated engines registered behind a ready-made endpoint. Prints what
//! to paste, runs until Ctrl-C or SIGTERM, then stops everything in order.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use switchyard_cluster::{ClusterSpec, LocalCluster, variants_json};
use switchyard_engine_sim::SimConfig;
use switchyard_shared::RoutingStrategy;

use crate::admin::UsageError;

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Simulated engines (vLLM stand-ins) behind the endpoint.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Routers; the first listens on --listen, the next ones on the following ports.
    #[arg(long, default_value_t = 1)]
    pub routers: usize,
    /// Address of the first router.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Address of the control plane's gRPC API.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub control_listen: SocketAddr,
    /// Name of the endpoint created.
    #[arg(long, default_value = "chat")]
    pub endpoint: String,
    /// Routing strategy of the endpoint.
    #[arg(long, default_value = "PREFIX_AWARE")]
    pub strategy: RoutingStrategy,
    /// PrefixLength for PREFIX_AWARE (1024-65536).
    #[arg(long, default_value_t = 4096)]
    pub prefix_length: u32,
    /// ConcurrencyThreshold for PREFIX_AWARE (1-1024).
    #[arg(long, default_value_t = 10)]
    pub concurrency_threshold: u32,
    /// Time scale of the simulated engines (1: a 70B model's real speed; 0.1: ten times faster).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Keep the control plane's state here (default: a temporary directory, removed on exit).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Traces of the control plane and the routers go to this OTLP/gRPC collector.
    #[command(flatten)]
    pub telemetry: switchyard_telemetry::TelemetryArgs,
}

impl UpArgs {
    fn spec(&self) -> Result<ClusterSpec, UsageError> {
        use switchyard_process::check_range;
        check_range("--engines", self.engines, 1..=64)?;
        check_range("--routers", self.routers, 1..=16)?;
        let prefix = (self.strategy == RoutingStrategy::PrefixAware)
            .then_some((self.prefix_length, self.concurrency_threshold));
        let variants = variants_json(self.strategy.as_str(), prefix);
        // Check the config here so a bad flag is a usage error, named.
        let parsed = switchyard_shared::sagemaker::parse_production_variants(&variants)
            .map_err(|err| UsageError(err.to_string()))?;
        let config = switchyard_shared::EndpointConfig {
            endpoint_config_name: switchyard_shared::EndpointConfigName::new(&self.endpoint)
                .map_err(|err| UsageError(format!("--endpoint: {err}")))?,
            production_variants: parsed.variants,
            health_check_config: Default::default(),
            creation_time_ms: 0,
            disaggregation_config: None,
        };
        config.validate().map_err(|err| {
            let flag = if err.field.ends_with("PrefixLength") {
                "--prefix-length"
            } else {
                "--concurrency-threshold"
            };
            UsageError(format!("{flag}: {}", err.message))
        })?;
        let sim = SimConfig {
            time_scale: self.time_scale,
            ..SimConfig::default()
        };
        sim.validate()
            .map_err(|message| UsageError(format!("--time-scale: {message}")))?;
        let router_listen = (0..self.routers)
            .map(|index| {
                let port = if self.listen.port() == 0 {
                    0
                } else {
                    self.listen.port().saturating_add(index as u16)
                };
                SocketAddr::new(self.listen.ip(), port)
            })
            .collect();
        Ok(ClusterSpec {
            engines: self.engines,
            routers: self.routers,
            endpoint: self.endpoint.clone(),
            variants_json: variants,
            sim,
            data_dir: self.data_dir.clone(),
            control_listen: self.control_listen,
            router_listen,
            disaggregation: None,
            otlp_endpoint: self.telemetry.otlp_endpoint.clone(),
        })
    }
}

pub async fn run(args: UpArgs) -> anyhow::Result<()> {
    let spec = args.spec()?;
    eprintln!(
        "starting a control plane, {} router(s) and {} simulated engine(s)...",
        spec.routers, spec.engines
    );
    let cluster = LocalCluster::start(spec)
        .await
        .context("the local cluster did not start")?;
    print_welcome(&args, &cluster);
    switchyard_process::shutdown_signal().await;
    eprintln!("stopping...");
    cluster.shutdown().await;
    eprintln!("stopped");
    Ok(())
}

fn print_welcome(args: &UpArgs, cluster: &LocalCluster) {
    let router = &cluster.router_urls[0];
    let endpoint = &cluster.endpoint;
    let strategy = match args.strategy {
        RoutingStrategy::PrefixAware => format!(
            "PREFIX_AWARE, PrefixLength {}, ConcurrencyThreshold {}",
            args.prefix_length, args.concurrency_threshold
        ),
        other => other.to_string(),
    };
    println!();
    println!("Switchyard is up.");
    println!(
        "  control plane  {}   (gRPC admin API)",
        cluster.control_plane_url
    );
    if let Some(url) = cluster.control_metrics_url() {
        println!("  control plane  {url}   (Prometheus metrics)");
    }
    for (index, url) in cluster.router_urls.iter().enumerate() {
        println!("  router {index}       {url}");
    }
    if let Some(url) = &args.telemetry.otlp_endpoint {
        println!("  traces         {url}   (OTLP/gRPC collector)");
    }
    for (index, url) in cluster.engine_urls.iter().enumerate() {
        println!("  engine-{index}       {url}   (simulated vLLM)");
    }
    println!("  endpoint       {endpoint} ({strategy})");
    println!();
    println!("Try it:");
    println!(
        "  curl -s {router}/endpoints/{endpoint}/openai/v1/chat/completions -H 'content-type: application/json' -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}],\"max_tokens\":16}}' -i"
    );
    println!();
    println!("With the OpenAI Python client:");
    println!("  from openai import OpenAI");
    println!("  client = OpenAI(base_url=\"{router}/v1\", api_key=\"unused\")");
    println!(
        "  reply = client.chat.completions.create(model=\"{endpoint}\", messages=[{{\"role\": \"user\", \"content\": \"Hello!\"}}])"
    );
    println!("  print(reply.choices[0].message.content)");
    println!(
        "  first = client.responses.create(model=\"{endpoint}\", input=\"Hello!\")   # stored on one instance"
    );
    println!(
        "  client.responses.create(model=\"{endpoint}\", input=\"And then?\", previous_response_id=first.id)   # reaches it from any router"
    );
    println!();
    println!("Look around:");
    println!(
        "  switchyard --control-plane {} instance list",
        cluster.control_plane_url
    );
    println!("  curl -s {router}/metrics | grep switchyard_router_requests_total");
    println!();
    println!("Ctrl-C stops everything.");
}
