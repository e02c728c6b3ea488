//! The simulator's knobs: one `--flag` each, with defaults for Llama-3.1-70B (bf16) served by
//! vLLM on 8×H100 80 GB (an ml.p5.48xlarge).

use std::sync::Arc;

use clap::Parser;
use switchyard_shared::InstanceRole;

use crate::cache::Lora;
use crate::engine::{Limits, Scheduler, TimeModel};
use crate::faults::{FaultRateError, Faults};
use crate::kv_events::KvEventsFormat;

/// Configuration of one simulated vLLM instance. Every field is a command-line flag of
/// `switchyard-engine-sim`; [`Default`] gives the flags' defaults.
///
/// Durations are in model time; `--time-scale` multiplies every one of them on the wall clock
/// (0.1 runs ten times faster). Latency metrics are reported in model time.
#[derive(Debug, Clone, clap::Args)]
pub struct SimConfig {
    /// Model name this engine serves; a request naming another model (or adapter) gets
    /// vLLM's 404.
    #[arg(long, default_value = "sim", value_name = "NAME")]
    pub served_model_name: String,

    /// LoRA adapters served beside the model, as vLLM's --lora-modules (the path is ignored):
    /// a request whose `model` names one runs under it, its KV blocks keyed by the adapter and
    /// published with its `lora_id` (1-based, in this order) and `lora_name`.
    #[arg(long, num_args = 1.., value_name = "NAME[=PATH]")]
    pub lora_modules: Vec<String>,

    /// Data-parallel ranks behind this server, as vLLM's --data-parallel-size: a request's
    /// `X-data-parallel-rank` header must name one (0..N), else vLLM's 400. The simulator
    /// runs one engine whatever the size (its KV events are rank 0's).
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub data_parallel_size: u32,

    /// Disaggregation role: both, prefill or decode. All roles serve every request (a prefill
    /// instance also serves plain requests whole, a decode instance prefills requests that
    /// carry no kv_transfer_params), as vLLM with NixlConnector does.
    #[arg(long, default_value = "both", value_name = "both|prefill|decode")]
    pub role: InstanceRole,

    /// Multiplies every simulated duration on the wall clock (0.01 runs 100× faster).
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    pub time_scale: f64,

    /// A model folder (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`): the
    /// prompt's token ids (`/tokenize`, usage, KV blocks and events) are then the model's own,
    /// rendered and tokenized as vLLM does, instead of the built-in approximation. A request
    /// the renderer does not follow (images, its own chat_template) gets a 400 that says so.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<std::path::PathBuf>,

    /// Tokens per KV-cache block (vLLM's --block-size).
    #[arg(long, default_value_t = 16, value_name = "TOKENS")]
    pub block_size: usize,

    /// KV-cache capacity in blocks. Default: (8 GPUs × 80 GB × 0.9 memory utilization − 141 GB
    /// of bf16 weights − ~20 GB activations) / 327,680 bytes per token / 16 tokens per block.
    #[arg(long, default_value_t = 79_000, value_name = "BLOCKS")]
    pub kv_cache_blocks: usize,

    /// Most requests running (batched) at once (vLLM's --max-num-seqs).
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub max_num_seqs: usize,

    /// Token budget of one engine step: one per decoding request, the rest for prefill chunks
    /// (vLLM's --max-num-batched-tokens).
    #[arg(long, default_value_t = 8192, value_name = "TOKENS")]
    pub max_num_batched_tokens: u64,

    /// Longest prompt plus max_tokens accepted (Llama 3.1's 128 K context).
    #[arg(long, default_value_t = 131_072, value_name = "TOKENS")]
    pub max_model_len: u32,

    /// Output tokens of a request that sets neither max_tokens nor max_completion_tokens.
    #[arg(long, default_value_t = 16, value_name = "TOKENS")]
    pub default_max_tokens: u32,

    /// Fixed cost of every engine step (scheduling, sampling, kernel launches), in ms.
    #[arg(long, default_value_t = 4.0, value_name = "MS")]
    pub step_overhead_ms: f64,

    /// Prefill throughput in uncached prompt tokens per second. Default: 140 GFLOP per token
    /// for a 70 B model at ~40–50% MFU on 8×H100.
    #[arg(long, default_value_t = 25_000.0, value_name = "TOKENS")]
    pub prefill_tokens_per_s: f64,

    /// Added to every step that runs the model, in ms: reading 140 GB of weights from the HBM
    /// of 8 GPUs once per forward pass, whether it prefills, decodes or both. A short prompt's
    /// prefill is bound by this read as a decode step is. (Older name: --decode-ms-per-step.)
    #[arg(
        long,
        alias = "decode-ms-per-step",
        default_value_t = 10.0,
        value_name = "MS"
    )]
    pub weights_ms_per_step: f64,

    /// Added to a decoding step per 1,000 tokens of context of its decoding requests, in ms
    /// (reading their KV cache).
    #[arg(
        long = "kv-read-ms-per-1k-tokens",
        default_value_t = 0.02,
        value_name = "MS"
    )]
    pub kv_read_ms_per_1k_tokens: f64,

    /// KV-transfer bandwidth for disaggregated prefill, in gigabytes per second.
    #[arg(long, default_value_t = 50.0, value_name = "GB_PER_S")]
    pub kv_transfer_gbps: f64,

    /// KV-cache bytes per token. Default: Llama-70B in bf16, 80 layers × 8 KV heads × 128
    /// dims × 2 (K and V) × 2 bytes.
    #[arg(long, default_value_t = 327_680, value_name = "BYTES")]
    pub kv_bytes_per_token: u64,

    /// Fraction of inference requests answered with a 500 error.
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub fail_rate: f64,

    /// Fraction of inference requests accepted and never answered (until the client leaves).
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub hang_rate: f64,

    /// Fraction of inference requests whose connection is closed after a few streamed tokens
    /// (before any body for non-streaming requests).
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub die_mid_stream_rate: f64,

    /// Fraction of inference requests that stream a few tokens and then send nothing more,
    /// keeping the connection open (non-streaming: the response head, then nothing).
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub stall_mid_stream_rate: f64,

    /// Fraction of streamed inference requests that end after a few tokens with vLLM's error
    /// event (InternalServerError, code 500) and [DONE], as when vLLM's engine core fails
    /// (non-streaming: a 500 answer).
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub error_mid_stream_rate: f64,

    /// Fraction of `POST /tokenize` requests answered with a 500 error.
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub tokenize_fail_rate: f64,

    /// Fraction of `POST /tokenize` requests accepted and never answered.
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub tokenize_hang_rate: f64,

    /// Fraction of a decode engine's KV pulls (NixlConnector), and of an LMCache PD
    /// receiver's loads for a prompt of token ids, that fail, as a transfer error would; see
    /// --kv-load-failure-policy.
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    pub kv_pull_fail_rate: f64,

    /// NixlConnector: how long a prefill engine keeps a hand-off's blocks for a decoder to
    /// pull, in seconds on the wall clock, not scaled by --time-scale (vLLM 0.32's
    /// `kv_connector_extra_config.kv_lease_duration`, 30): a pull after that finds nothing, and
    /// the decoder fails the request as for any failed pull.
    #[arg(long, default_value_t = 30.0, value_name = "S")]
    pub kv_lease_s: f64,

    /// Seed of the fault-injection random numbers.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub seed: u64,

    /// Responses API responses kept for follow-ups and GET /v1/responses/{id} (vLLM with
    /// VLLM_ENABLE_RESPONSES_API_STORE=1 keeps them all); beyond it the oldest is forgotten.
    #[arg(long, default_value_t = 10_000, value_name = "N")]
    pub max_stored_responses: usize,

    /// How many of the latest requests to keep for GET /sim/requests.
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub record_requests: usize,

    /// On shutdown, how long in-flight requests may take to finish before their connections
    /// are dropped, in (wall-clock) seconds.
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    pub shutdown_grace_s: f64,

    /// LMCache disaggregation: as a prefill engine, push each prompt's KV blocks to the decode
    /// engine at this base URL (http://HOST:PORT) after prefilling it, as LMCache's PD
    /// backend does for the decoder in its config.
    #[arg(long, value_name = "URL")]
    pub kv_push_to: Option<String>,

    /// Current LMCache's PD backend on a prefill engine (`pd_role: sender`): the proxy's
    /// notice socket (`pd_proxy_host`/`pd_proxy_port`), tcp://HOST:PORT. Every completions
    /// request must then carry `kv_transfer_params.disagg_spec`; its KV blocks go to the
    /// receiver the spec names and a "KV ready" notice per rank to this address.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    pub lmcache_pd_proxy: Option<String>,

    /// Current LMCache's PD backend on a decode engine (`pd_role: receiver`): the alloc port
    /// of each tensor-parallel rank (`pd_peer_alloc_port`), comma-separated.
    #[arg(long, value_name = "PORT,...", value_delimiter = ',')]
    pub lmcache_receiver_alloc_ports: Vec<u16>,

    /// The host the receiver's ports listen on (`pd_peer_host`).
    #[arg(long, default_value = "127.0.0.1", value_name = "HOST")]
    pub lmcache_receiver_host: String,

    /// Fault: an LMCache PD sender transfers the KV cache but never sends its notices.
    #[arg(long)]
    pub lmcache_drop_notices: bool,

    /// An LMCache PD sender's first token ends each answer (`finish_reason: "stop"`, as an
    /// end of sequence would).
    #[arg(long)]
    pub lmcache_first_token_stops: bool,

    /// NixlConnector on a decode engine (vLLM's `kv_load_failure_policy` in
    /// `--kv-transfer-config`): what happens to a disaggregated request whose KV cache cannot
    /// be pulled: `fail` answers an error (vLLM's default: 500, or an error event in a
    /// stream), `recompute` prefills the prompt here instead.
    #[arg(long, value_enum, default_value_t = KvLoadFailurePolicy::Fail)]
    pub kv_load_failure_policy: KvLoadFailurePolicy,

    /// NixlConnector: the host this engine's side channel reports in `remote_host`
    /// (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST, which is `localhost` unless set: a decoder on
    /// another host needs it set, or a router that rewrites it). The side channel listens on
    /// this host, apart from the HTTP port.
    #[arg(
        long,
        env = "VLLM_NIXL_SIDE_CHANNEL_HOST",
        default_value = "localhost",
        value_name = "HOST"
    )]
    pub side_channel_host: String,

    /// NixlConnector: the side channel's port, reported in `remote_port` (vLLM's
    /// VLLM_NIXL_SIDE_CHANNEL_PORT, 5600 there; one per engine on a host). 0 picks a free port.
    #[arg(
        long,
        env = "VLLM_NIXL_SIDE_CHANNEL_PORT",
        default_value_t = 0,
        value_name = "PORT"
    )]
    pub side_channel_port: u16,

    /// This engine's id in kv_transfer_params (`remote_engine_id`). Default: generated at
    /// start.
    #[arg(long, value_name = "ID")]
    pub engine_id: Option<String>,

    /// Publish KV-cache events as vLLM's `--kv-events-config` does (ZMQ PUB, vLLM's wire
    /// format) on this endpoint. Port 0 picks a free port, shown in the log and at
    /// GET /sim/kv-events; tcp://*:PORT binds every interface. Default: no events.
    #[arg(long, value_name = "tcp://HOST:PORT")]
    pub kv_events: Option<String>,

    /// Serve vLLM's KV-event replay socket (ZMQ ROUTER: "send me the batches from sequence N")
    /// on this endpoint; needs --kv-events. Port 0 picks a free port.
    #[arg(long, value_name = "tcp://HOST:PORT", requires = "kv_events")]
    pub kv_events_replay: Option<String>,

    /// Topic frame of every KV-event message (vLLM's "topic"; empty, vLLM's default).
    #[arg(long, default_value = "", value_name = "TOPIC")]
    pub kv_events_topic: String,

    /// msgpack layout of each KV event: array (a tagged positional array, vLLM up to 0.23 and
    /// its example subscriber) or map (a tagged map, later vLLM). The batch is an array in both.
    #[arg(long, value_enum, default_value_t = KvEventsFormat::Array)]
    pub kv_events_format: KvEventsFormat,

    /// KV-event batches kept for replay (vLLM's buffer_steps).
    #[arg(long, default_value_t = 10_000, value_name = "BATCHES")]
    pub kv_events_replay_buffer: usize,
}

/// vLLM's `kv_load_failure_policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KvLoadFailurePolicy {
    /// The request fails with an error (vLLM's default).
    Fail,
    /// The prompt is prefilled on this engine instead.
    Recompute,
}

/// Parses an empty command line, so that [`Default`] always agrees with the flags.
#[derive(Parser)]
struct DefaultsOnly {
    #[command(flatten)]
    config: SimConfig,
}

impl Default for SimConfig {
    fn default() -> Self {
        DefaultsOnly::parse_from(["switchyard-engine-sim"]).config
    }
}

/// A flag value [`SimConfig::validate`] refuses; the message names the flag.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("{flag} must be a positive number, got {value}")]
    NotPositive { flag: &'static str, value: f64 },
    #[error("{flag} must be zero or more, got {value}")]
    Negative { flag: &'static str, value: f64 },
    #[error("{flag} must be at least 1, got {value}")]
    BelowOne { flag: &'static str, value: u64 },
    #[error("{flag} must not be empty")]
    Empty { flag: &'static str },
    #[error("--lora-modules {name:?}: {why}")]
    LoraModule { name: String, why: &'static str },
    #[error("--kv-push-to {url:?} must be an http:// URL")]
    NotHttpUrl { url: String },
    #[error("--kv-events-replay needs --kv-events")]
    ReplayWithoutEvents,
    #[error(
        "{flag} {endpoint:?}: give tcp://IP:PORT to bind (an IP address or *, port 0 for any free port), e.g. tcp://127.0.0.1:5557"
    )]
    NotBindable {
        flag: &'static str,
        endpoint: String,
    },
    #[error(transparent)]
    FaultRate(#[from] FaultRateError),
}

fn lora_names(modules: &[String]) -> impl Iterator<Item = &str> {
    modules.iter().map(|module| {
        module
            .split_once('=')
            .map_or(module.as_str(), |(name, _)| name)
    })
}

/// The adapter of `modules` (`--lora-modules` values) that `model` names, if any.
pub(crate) fn lora_of(modules: &[String], model: Option<&str>) -> Option<Lora> {
    let model = model?;
    let position = lora_names(modules).position(|name| name == model)?;
    Some(Lora {
        id: u32::try_from(position + 1).unwrap_or(u32::MAX),
        name: Arc::from(model),
    })
}

impl SimConfig {
    /// The names of `--lora-modules`, in order.
    pub(crate) fn lora_names(&self) -> impl Iterator<Item = &str> {
        lora_names(&self.lora_modules)
    }

    /// The adapter `model` names, if it is one of `--lora-modules`.
    pub(crate) fn lora(&self, model: Option<&str>) -> Option<Lora> {
        lora_of(&self.lora_modules, model)
    }

    /// Checks every value; the error names the flag.
    pub fn validate(&self) -> Result<(), ConfigError> {
        positive("--time-scale", self.time_scale)?;
        positive("--kv-lease-s", self.kv_lease_s)?;
        positive("--prefill-tokens-per-s", self.prefill_tokens_per_s)?;
        positive("--kv-transfer-gbps", self.kv_transfer_gbps)?;
        non_negative("--step-overhead-ms", self.step_overhead_ms)?;
        non_negative("--weights-ms-per-step", self.weights_ms_per_step)?;
        non_negative("--kv-read-ms-per-1k-tokens", self.kv_read_ms_per_1k_tokens)?;
        non_negative("--shutdown-grace-s", self.shutdown_grace_s)?;
        at_least_one("--block-size", self.block_size as u64)?;
        at_least_one("--kv-cache-blocks", self.kv_cache_blocks as u64)?;
        at_least_one("--max-num-seqs", self.max_num_seqs as u64)?;
        at_least_one("--max-num-batched-tokens", self.max_num_batched_tokens)?;
        at_least_one("--max-model-len", u64::from(self.max_model_len))?;
        at_least_one("--default-max-tokens", u64::from(self.default_max_tokens))?;
        at_least_one("--max-stored-responses", self.max_stored_responses as u64)?;
        at_least_one("--kv-bytes-per-token", self.kv_bytes_per_token)?;
        if self.served_model_name.trim().is_empty() {
            return Err(ConfigError::Empty {
                flag: "--served-model-name",
            });
        }
        for (index, name) in self.lora_names().enumerate() {
            let why = if name.trim().is_empty() {
                Some("an adapter needs a name")
            } else if name == self.served_model_name {
                Some("is the served model's name")
            } else if self.lora_names().take(index).any(|other| other == name) {
                Some("is given twice")
            } else {
                None
            };
            if let Some(why) = why {
                return Err(ConfigError::LoraModule {
                    name: name.to_owned(),
                    why,
                });
            }
        }
        if let Some(url) = &self.kv_push_to
            && !url.starts_with("http://")
        {
            return Err(ConfigError::NotHttpUrl { url: url.clone() });
        }
        if self.side_channel_host.trim().is_empty() {
            return Err(ConfigError::Empty {
                flag: "--side-channel-host",
            });
        }
        if let Some(id) = &self.engine_id
            && id.trim().is_empty()
        {
            return Err(ConfigError::Empty {
                flag: "--engine-id",
            });
        }
        if let Some(endpoint) = &self.kv_events {
            bindable_endpoint("--kv-events", endpoint)?;
        }
        if let Some(endpoint) = &self.kv_events_replay {
            if self.kv_events.is_none() {
                return Err(ConfigError::ReplayWithoutEvents);
            }
            bindable_endpoint("--kv-events-replay", endpoint)?;
        }
        at_least_one(
            "--kv-events-replay-buffer",
            self.kv_events_replay_buffer as u64,
        )?;
        Ok(self.faults().validate()?)
    }

    /// The fault knobs given on the command line.
    pub fn faults(&self) -> Faults {
        Faults {
            fail_rate: self.fail_rate,
            hang_rate: self.hang_rate,
            die_mid_stream_rate: self.die_mid_stream_rate,
            stall_mid_stream_rate: self.stall_mid_stream_rate,
            error_mid_stream_rate: self.error_mid_stream_rate,
            tokenize_fail_rate: self.tokenize_fail_rate,
            tokenize_hang_rate: self.tokenize_hang_rate,
            kv_pull_fail_rate: self.kv_pull_fail_rate,
        }
    }
}

// The engine model is pure and knows no flags: what it is built from is read from the flags
// here.

impl TimeModel {
    pub fn from_config(config: &SimConfig) -> Self {
        Self {
            step_overhead_s: config.step_overhead_ms / 1e3,
            prefill_tokens_per_s: config.prefill_tokens_per_s,
            weights_s_per_step: config.weights_ms_per_step / 1e3,
            kv_read_s_per_token: config.kv_read_ms_per_1k_tokens / 1e6,
            kv_transfer_bytes_per_s: config.kv_transfer_gbps * 1e9,
            kv_bytes_per_token: config.kv_bytes_per_token as f64,
        }
    }
}

impl Limits {
    pub fn from_config(config: &SimConfig) -> Self {
        Self {
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
            block_size: config.block_size.max(1),
            kv_cache_blocks: config.kv_cache_blocks,
        }
    }
}

impl Scheduler {
    pub fn from_config(config: &SimConfig) -> Self {
        Self::new(TimeModel::from_config(config), Limits::from_config(config))
    }
}

/// `tcp://HOST:PORT` to bind: an IP address (or `*` for every interface) and a port (0: any).
fn bindable_endpoint(flag: &'static str, endpoint: &str) -> Result<(), ConfigError> {
    let usage = || ConfigError::NotBindable {
        flag,
        endpoint: endpoint.to_owned(),
    };
    let address = endpoint.strip_prefix("tcp://").ok_or_else(usage)?;
    let (host, port) = address.rsplit_once(':').ok_or_else(usage)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host != "*" && host.parse::<std::net::IpAddr>().is_err() {
        return Err(usage());
    }
    port.parse::<u16>().map(|_| ()).map_err(|_| usage())
}

fn positive(flag: &'static str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::NotPositive { flag, value })
    }
}

fn non_negative(flag: &'static str, value: f64) -> Result<(), ConfigError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::Negative { flag, value })
    }
}

fn at_least_one(flag: &'static str, value: u64) -> Result<(), ConfigError> {
    if value >= 1 {
        Ok(())
    } else {
        Err(ConfigError::BelowOne { flag, value })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_documented_values_and_validate() {
        let config = SimConfig::default();
        assert_eq!(config.served_model_name, "sim");
        assert_eq!(config.role, InstanceRole::Both);
        assert_eq!(config.block_size, 16);
        assert_eq!(config.kv_cache_blocks, 79_000);
        assert_eq!(config.max_num_seqs, 256);
        assert_eq!(config.max_num_batched_tokens, 8192);
        assert_eq!(config.kv_bytes_per_token, 327_680);
        assert!((config.time_scale - 1.0).abs() < f64::EPSILON);
        assert_eq!(config.validate(), Ok(()));
    }

    #[test]
    fn the_engine_model_of_the_defaults_is_the_one_its_tests_use() {
        let config = SimConfig::default();
        assert_eq!(
            TimeModel::from_config(&config),
            crate::engine::tests::model()
        );
        assert_eq!(Limits::from_config(&config), crate::engine::tests::limits());
    }

    #[test]
    fn validate_names_the_bad_flag() {
        let mut config = SimConfig {
            time_scale: 0.0,
            ..SimConfig::default()
        };
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--time-scale")
        );
        config.time_scale = 1.0;
        config.fail_rate = 1.5;
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--fail-rate")
        );
        config.fail_rate = 0.0;
        config.block_size = 0;
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--block-size")
        );
        config.block_size = 16;
        for bad in [
            "127.0.0.1:5557",
            "tcp://localhost:5557",
            "tcp://127.0.0.1",
            "tcp://1.2.3.4:x",
        ] {
            config.kv_events = Some(bad.into());
            assert!(
                config
                    .validate()
                    .unwrap_err()
                    .to_string()
                    .contains("--kv-events"),
                "{bad}"
            );
        }
        config.kv_events = Some("tcp://*:0".into());
        config.kv_events_replay = Some("tcp://[::1]:0".into());
        assert_eq!(config.validate(), Ok(()));
        config.kv_events = None;
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--kv-events-replay")
        );
    }

    #[test]
    fn error_messages_are_the_ones_users_see() {
        let message = |flags: &[&str]| {
            let command_line = std::iter::once(&"sim").chain(flags);
            let parsed = DefaultsOnly::try_parse_from(command_line).expect("valid flags");
            parsed.config.validate().unwrap_err().to_string()
        };
        let bind_usage = "give tcp://IP:PORT to bind (an IP address or *, port 0 for any free \
                          port), e.g. tcp://127.0.0.1:5557";
        for (flags, expected) in [
            (
                &["--time-scale=0"][..],
                "--time-scale must be a positive number, got 0".into(),
            ),
            (
                &["--step-overhead-ms=-1"],
                "--step-overhead-ms must be zero or more, got -1".into(),
            ),
            (
                &["--block-size=0"],
                "--block-size must be at least 1, got 0".into(),
            ),
            (
                &["--served-model-name= "],
                "--served-model-name must not be empty".into(),
            ),
            (&["--engine-id="], "--engine-id must not be empty".into()),
            (
                &["--lora-modules", "a=/x", "a"],
                r#"--lora-modules "a": is given twice"#.into(),
            ),
            (
                &["--lora-modules", "sim"],
                r#"--lora-modules "sim": is the served model's name"#.into(),
            ),
            (
                &["--lora-modules", "", "b"],
                r#"--lora-modules "": an adapter needs a name"#.into(),
            ),
            (
                &["--kv-push-to=https://x"],
                r#"--kv-push-to "https://x" must be an http:// URL"#.into(),
            ),
            (
                &["--kv-events=tcp://x:1"],
                format!(r#"--kv-events "tcp://x:1": {bind_usage}"#),
            ),
            (
                &["--hang-rate=2"],
                "--hang-rate (hang_rate) must be between 0 and 1, got 2".into(),
            ),
        ] {
            assert_eq!(message(flags), expected, "{flags:?}");
        }
        // Only a config built in code can ask for replay without events (the flag requires it).
        let replay_alone = SimConfig {
            kv_events_replay: Some("tcp://*:0".into()),
            ..SimConfig::default()
        };
        let error = replay_alone.validate().unwrap_err().to_string();
        assert_eq!(error, "--kv-events-replay needs --kv-events");
    }

    #[test]
    fn parses_flags() {
        let parsed = DefaultsOnly::try_parse_from([
            "sim",
            "--role",
            "prefill",
            "--time-scale",
            "0.01",
            "--served-model-name",
            "llama",
        ])
        .expect("valid flags");
        assert_eq!(parsed.config.role, InstanceRole::Prefill);
        assert_eq!(parsed.config.served_model_name, "llama");
        assert!(DefaultsOnly::try_parse_from(["sim", "--role", "neither"]).is_err());
    }

    #[test]
    fn the_weights_read_keeps_its_older_flag_name() {
        for flag in ["--weights-ms-per-step", "--decode-ms-per-step"] {
            let parsed = DefaultsOnly::try_parse_from(["sim", flag, "7.5"]).expect("valid flags");
            assert_eq!(parsed.config.weights_ms_per_step, 7.5, "{flag}");
        }
    }
}
