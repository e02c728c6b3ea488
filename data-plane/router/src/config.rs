//! The router's command line: flags → [`RouterConfig::validate`] → an immutable [`Settings`],
//! checked before any port is bound.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use switchyard_process::{UsageError, check_range};
use switchyard_telemetry::{TelemetryArgs, TelemetrySettings};

use crate::routing::static_file::{self, StaticConfig};
use crate::server::admission::Limits;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum UpstreamProtocol {
    Http1,
    H2c,
}

/// Command-line configuration of `switchyard-router`.
#[derive(Debug, Clone, clap::Args)]
pub struct RouterConfig {
    /// Address the HTTP server listens on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Control-plane gRPC URLs, comma-separated; the router fails over between them.
    /// Default: $SWITCHYARD_CONTROL_PLANE (ignored with --config), then
    /// http://127.0.0.1:50051.
    #[arg(long, value_delimiter = ',', conflicts_with = "config")]
    pub control_plane: Vec<String>,
    /// Route from a static file instead of a control plane (JSON, or YAML by extension).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// PEM CA certificate to trust for an https:// control plane.
    #[arg(long)]
    pub tls_ca: Option<PathBuf>,
    /// File holding the bearer token the control plane asks routers for (its
    /// --router-token-file).
    #[arg(long)]
    pub control_plane_token_file: Option<PathBuf>,
    /// Name of this router in load reports. Default: random.
    #[arg(long)]
    pub router_id: Option<String>,
    /// How often in-flight counts are reported to the control plane (ms).
    #[arg(long, default_value_t = 100)]
    pub load_report_interval_ms: u64,
    /// Instances tried per request before answering 503. Only attempts that provably never
    /// reached an engine (connection refused or timed out, HTTP/2 stream refused) move on to
    /// the next instance.
    #[arg(long, default_value_t = 3)]
    pub max_attempts: usize,
    /// Also retry, once, on another instance when the connection failed after the request
    /// was sent (reset, closed before the response head). Off by default: the engine may
    /// already have done the work, and a request that crashes engines would take down one per
    /// attempt. Retried requests say `x-switchyard-route: retry-after-send`.
    #[arg(long)]
    pub retry_after_send: bool,
    /// Add `x-switchyard-decision-us` (microseconds from a request's arrival to its routing
    /// decision) to every answer, for benchmarks and debugging. Off by default: under
    /// KV_AWARE with a router tokenizer, it tells a client whether text was already in the
    /// router's token-id cache (which other clients' prompts filled).
    #[arg(long)]
    pub decision_time_header: bool,
    /// Consecutive connection failures (refused, reset) before this router stops sending to
    /// an instance for --eject-seconds. Timeouts and clients' cancellations do not count.
    #[arg(long, default_value_t = 3)]
    pub eject_after_failures: u32,
    /// How long an ejected instance is left alone (seconds).
    #[arg(long, default_value_t = 5)]
    pub eject_seconds: u64,
    /// Connection timeout to instances (ms). A connection not made in time is tried on the
    /// next instance.
    #[arg(long, default_value_t = 2000)]
    pub connect_timeout_ms: u64,
    /// Seconds an idle connection to an instance is kept for reuse. Keep it below the
    /// engines' own keep-alive timeout (vLLM's uvicorn: 5 s), so that the router never
    /// writes a request onto a connection the engine is closing (such a request could not
    /// be proven unsent, so it would fail instead of being retried).
    #[arg(long, default_value_t = 4, value_name = "SECONDS")]
    pub upstream_idle_timeout_seconds: u64,
    /// Seconds a client may take to send a request's headers before the router closes the
    /// connection; also how long a connection may sit idle (HTTP/1 keep-alive between
    /// requests, or no traffic at all): keep clients' idle pool timeouts below it.
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    pub client_header_timeout_seconds: u64,
    /// Seconds a client may take to send a request's whole body; then 408.
    #[arg(long, default_value_t = 60, value_name = "SECONDS")]
    pub client_body_timeout_seconds: u64,
    /// Seconds to wait for an instance's response head after sending it a request; then 504
    /// (not retried). A non-streaming completion's head comes only after the whole
    /// generation, so keep this above your longest generation.
    #[arg(long, default_value_t = 600, value_name = "SECONDS")]
    pub upstream_header_timeout_seconds: u64,
    /// Largest gap, in seconds, between two frames of an answer once it began. A streamed
    /// (SSE) answer that stalls this long ends with a final `data: {"error":…}` event
    /// (code `stream_idle_timeout`) and no `[DONE]`; other bodies are cut.
    #[arg(long, default_value_t = 120, value_name = "SECONDS")]
    pub stream_idle_timeout_seconds: u64,
    /// Client connections open at once, over all serving threads. Beyond it a new
    /// connection gets 503 with Retry-After and is closed.
    #[arg(long, default_value_t = 8192, value_name = "N")]
    pub max_connections: usize,
    /// Requests in flight at once, over all serving threads (from arrival until the last byte
    /// of the answer). Beyond it: 503 with Retry-After.
    #[arg(long, default_value_t = 4096, value_name = "N")]
    pub max_in_flight: usize,
    /// Request-body bytes held in memory at once, over all requests (a body is held from
    /// arrival until the instance's response head). Beyond it: 503 with Retry-After. A byte
    /// count with an optional KiB, MiB or GiB suffix.
    #[arg(long, default_value = "512MiB", value_name = "BYTES", value_parser = parse_byte_size)]
    pub max_buffered_bytes: u64,
    /// Flow control (variants with MaxInFlightPerInstance): requests that may wait at once in
    /// each variant's queue on this router. Beyond it: 503 with Retry-After.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub max_queued_requests: usize,
    /// Flow control: longest wait in a variant's queue, in seconds; then 503 with
    /// Retry-After.
    #[arg(long, default_value_t = 30, value_name = "SECONDS")]
    pub queue_timeout_seconds: u64,
    /// Flow control: order the queue by the clients' `x-switchyard-priority` and
    /// `x-switchyard-fairness-id` headers and the body's `priority`. Off by default: any
    /// client could then put itself first; without it the two headers are removed (not read,
    /// not forwarded), every request has priority 0, and fairness ids come from the body's
    /// `safety_identifier` or `user`. Turn it on when an authenticating gateway in front of
    /// the router sets these headers.
    #[arg(long)]
    pub trust_flow_headers: bool,
    /// Protocol to instances that do not name one (an instance's own `protocol`, set at
    /// registration or in the static file, wins): pooled HTTP/1.1 keep-alive connections
    /// (what vLLM's server speaks), or h2c (HTTP/2 without TLS, prior knowledge: requests
    /// multiplexed on one connection per instance and serving thread) for engines that serve
    /// it. The control plane probes instances without a protocol over HTTP/1.1: register
    /// h2c-only engines with `--protocol h2c`.
    #[arg(long, value_enum, default_value_t = UpstreamProtocol::Http1)]
    pub upstream_protocol: UpstreamProtocol,
    /// Seconds to finish in-flight requests (streams included) after SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_seconds: u64,
    /// Directory of Hugging Face tokenizers for disaggregated endpoints whose config names
    /// one (`Tokenizer: NAME` → `DIR/NAME/tokenizer.json` or `DIR/NAME.json`). Without it,
    /// or when a file is missing, prompts are counted with cl100k_base (logged, and counted
    /// in switchyard_router_tokenizer_fallbacks_total).
    #[arg(long, value_name = "DIR")]
    pub tokenizer_dir: Option<PathBuf>,
    /// Variants whose KvAwareRoutingConfig names a Tokenizer (a folder under --tokenizer-dir
    /// with the model's tokenizer.json, tokenizer_config.json and chat template) have their
    /// token ids computed in the router; this share of those requests (0 to 1) is also sent
    /// to an engine's /tokenize to check them (routed on the engine's ids; three differences
    /// among its last 16 checks turn that tokenizer off until restart).
    #[arg(long, default_value_t = crate::request::local_tokens::DEFAULT_CHECK_FRACTION, value_name = "FRACTION")]
    pub tokenize_check_fraction: f64,
    /// Bytes each router tokenizer may keep of cached piece ids (long stretches of prompt text
    /// between the chat template's special tokens, such as a shared system prompt), so they
    /// are not tokenized again. A byte count with an optional KiB, MiB or GiB suffix.
    #[arg(long, default_value = "64MiB", value_name = "BYTES", value_parser = parse_byte_size)]
    pub tokenize_cache_bytes: u64,
    /// LMCACHE_PD disaggregation: where this router binds the ZMQ PULL socket LMCache's
    /// prefill engines send their "KV ready" notices to (their LMCache config's
    /// `pd_proxy_host` and `pd_proxy_port`), e.g. tcp://0.0.0.0:7500. Without it an LMCACHE_PD
    /// endpoint's requests are served by a decoder alone (fallback no_notice_socket).
    #[arg(long, value_name = "tcp://HOST:PORT")]
    pub lmcache_notice_bind: Option<String>,
    /// The HOST:PORT other routers reach this router's notice socket at (request ids name it,
    /// so a notice that reaches another router is relayed here). Default: the bound address,
    /// which must then not be a wildcard (0.0.0.0, ::).
    #[arg(long, value_name = "HOST:PORT", requires = "lmcache_notice_bind")]
    pub lmcache_notice_advertise: Option<String>,
    /// Threads serving HTTP. Each runs its own single-threaded runtime and upstream
    /// connection pool, so a request never moves between threads (cross-thread wake-ups
    /// cost more than the routing decision). Default: one per CPU.
    #[arg(long, value_name = "N")]
    pub worker_threads: Option<usize>,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
    #[command(flatten)]
    pub kv: crate::kv::KvArgs,
}

/// Parses a byte count: digits with an optional `KiB`, `MiB` or `GiB` suffix.
pub fn parse_byte_size(text: &str) -> Result<u64, UsageError> {
    let text = text.trim();
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, ""),
    };
    let multiplier: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => {
            return Err(UsageError(format!(
                "unknown unit {other:?} in {text:?} (use a byte count with KiB, MiB or GiB)"
            )));
        }
    };
    let value: u64 = digits.parse().map_err(|_| {
        UsageError(format!(
            "{text:?} is not a byte count such as 268435456 or 256MiB"
        ))
    })?;
    value
        .checked_mul(multiplier)
        .ok_or_else(|| UsageError(format!("{text:?} is too large")))
}

impl RouterConfig {
    /// A router following the given control planes, listening on `listen`, with every other
    /// flag at its default (one serving thread).
    pub fn with_control_plane(listen: SocketAddr, urls: Vec<String>) -> Self {
        Self {
            listen,
            control_plane: urls,
            config: None,
            tls_ca: None,
            control_plane_token_file: None,
            router_id: None,
            load_report_interval_ms: 100,
            max_attempts: 3,
            retry_after_send: false,
            decision_time_header: false,
            eject_after_failures: 3,
            eject_seconds: 5,
            connect_timeout_ms: 2000,
            upstream_idle_timeout_seconds: 4,
            client_header_timeout_seconds: 30,
            client_body_timeout_seconds: 60,
            upstream_header_timeout_seconds: 600,
            stream_idle_timeout_seconds: 120,
            max_connections: 8192,
            max_in_flight: 4096,
            max_buffered_bytes: 512 << 20,
            max_queued_requests: 1024,
            queue_timeout_seconds: 30,
            trust_flow_headers: false,
            upstream_protocol: UpstreamProtocol::Http1,
            shutdown_grace_seconds: 30,
            tokenizer_dir: None,
            tokenize_check_fraction: crate::request::local_tokens::DEFAULT_CHECK_FRACTION,
            tokenize_cache_bytes: switchyard_tokenize::DEFAULT_CACHE_BYTES as u64,
            lmcache_notice_bind: None,
            lmcache_notice_advertise: None,
            worker_threads: Some(1),
            telemetry: TelemetryArgs::default(),
            kv: crate::kv::KvArgs::default(),
        }
    }

    /// Checks the flags and reads the files they name.
    pub fn validate(&self) -> Result<Settings, UsageError> {
        let source = match &self.config {
            Some(path) => Source::Static(
                static_file::read_static_config(path).map_err(|err| UsageError(err.to_string()))?,
            ),
            None => Source::ControlPlane(self.control_plane_urls()?),
        };
        check_range(
            "--load-report-interval-ms",
            self.load_report_interval_ms,
            10..=10_000,
        )?;
        check_range("--max-attempts", self.max_attempts, 1..=10)?;
        if let Some(threads) = self.worker_threads {
            check_range("--worker-threads", threads, 1..=1024)?;
        }
        check_range(
            "--eject-after-failures",
            self.eject_after_failures,
            1..=1000,
        )?;
        check_range("--connect-timeout-ms", self.connect_timeout_ms, 1..=600_000)?;
        const DAY: u64 = 86_400;
        check_range(
            "--upstream-idle-timeout-seconds",
            self.upstream_idle_timeout_seconds,
            1..=DAY,
        )?;
        check_range(
            "--client-header-timeout-seconds",
            self.client_header_timeout_seconds,
            1..=DAY,
        )?;
        check_range(
            "--client-body-timeout-seconds",
            self.client_body_timeout_seconds,
            1..=DAY,
        )?;
        check_range(
            "--upstream-header-timeout-seconds",
            self.upstream_header_timeout_seconds,
            1..=DAY,
        )?;
        check_range(
            "--stream-idle-timeout-seconds",
            self.stream_idle_timeout_seconds,
            1..=DAY,
        )?;
        // The head deadline covers connecting too: a connect timeout at or above it would
        // surface as a 504 instead of a retry on another instance.
        if self.connect_timeout_ms >= self.upstream_header_timeout_seconds.saturating_mul(1000) {
            return Err(UsageError(format!(
                "--connect-timeout-ms ({}) must be below --upstream-header-timeout-seconds ({} s)",
                self.connect_timeout_ms, self.upstream_header_timeout_seconds
            )));
        }
        check_range("--max-connections", self.max_connections, 1..=10_000_000)?;
        check_range("--max-in-flight", self.max_in_flight, 1..=10_000_000)?;
        check_range(
            "--max-queued-requests",
            self.max_queued_requests,
            1..=1_000_000,
        )?;
        check_range(
            "--queue-timeout-seconds",
            self.queue_timeout_seconds,
            1..=DAY,
        )?;
        // At least one maximal body must fit, or every large request would be refused.
        check_range(
            "--max-buffered-bytes",
            self.max_buffered_bytes,
            crate::request::read::MAX_BODY_BYTES as u64..=u64::MAX,
        )?;
        if let Some(bind) = &self.lmcache_notice_bind {
            let address = bind.strip_prefix("tcp://").unwrap_or("");
            let Some((host, port)) = address.rsplit_once(':') else {
                return Err(UsageError(format!(
                    "--lmcache-notice-bind {bind:?} must be tcp://HOST:PORT"
                )));
            };
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(UsageError(format!(
                    "--lmcache-notice-bind {bind:?} must be tcp://HOST:PORT"
                )));
            }
            let wildcard = matches!(host, "0.0.0.0" | "*" | "[::]" | "::");
            if wildcard && self.lmcache_notice_advertise.is_none() {
                return Err(UsageError(format!(
                    "--lmcache-notice-bind {bind}: a wildcard address is no address other \
                     routers can relay notices to; set --lmcache-notice-advertise HOST:PORT"
                )));
            }
        }
        if let Some(advertise) = &self.lmcache_notice_advertise
            && advertise.rsplit_once(':').is_none_or(|(host, port)| {
                host.is_empty() || port.parse::<u16>().is_err() || advertise.contains(['/', '@'])
            })
        {
            return Err(UsageError(format!(
                "--lmcache-notice-advertise {advertise:?} must be HOST:PORT"
            )));
        }
        check_range(
            "--tokenize-check-fraction",
            self.tokenize_check_fraction,
            0.0..=1.0,
        )?;
        if self.tokenize_cache_bytes > 64 << 30 {
            return Err(UsageError(format!(
                "--tokenize-cache-bytes: {} is more than 64 GiB",
                self.tokenize_cache_bytes
            )));
        }
        if let Some(dir) = &self.tokenizer_dir
            && !dir.is_dir()
        {
            return Err(UsageError(format!(
                "--tokenizer-dir {}: not a directory",
                dir.display()
            )));
        }
        let tls_ca = match &self.tls_ca {
            Some(path) => Some(
                std::fs::read(path)
                    .map_err(|err| UsageError(format!("--tls-ca {}: {err}", path.display())))?,
            ),
            None => None,
        };
        let control_plane_token = self
            .control_plane_token_file
            .as_deref()
            .map(|path| switchyard_process::read_token_file(path, "--control-plane-token-file"))
            .transpose()?;
        let router_id = self
            .router_id
            .clone()
            .unwrap_or_else(|| format!("router-{}-{:08x}", std::process::id(), fastrand::u32(..)));
        let (kv, kv_tokenize_timeout, kv_tokenize_pause) = self.kv.validate()?;
        let seconds = Duration::from_secs;
        let telemetry = self.telemetry.validate()?;
        Ok(Settings {
            telemetry,
            config: self.clone(),
            source,
            tls_ca,
            control_plane_token,
            router_id,
            worker_threads: self.worker_threads.unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
            }),
            deadlines: Deadlines {
                connect: Duration::from_millis(self.connect_timeout_ms),
                upstream_idle: seconds(self.upstream_idle_timeout_seconds),
                client_header: seconds(self.client_header_timeout_seconds),
                client_body: seconds(self.client_body_timeout_seconds),
                upstream_header: seconds(self.upstream_header_timeout_seconds),
                stream_idle: seconds(self.stream_idle_timeout_seconds),
            },
            limits: Limits {
                max_connections: self.max_connections,
                max_in_flight: self.max_in_flight,
                max_buffered_bytes: self.max_buffered_bytes,
            },
            queue: crate::request::queue::QueueSettings {
                max_queued: self.max_queued_requests,
                timeout: seconds(self.queue_timeout_seconds),
                trust_headers: self.trust_flow_headers,
                grace: seconds(self.shutdown_grace_seconds),
            },
            kv,
            kv_tokenize_timeout,
            kv_tokenize_pause,
        })
    }

    /// `--control-plane`, else `$SWITCHYARD_CONTROL_PLANE`, else the local default; each
    /// URL checked, and a bad one named by where it came from.
    fn control_plane_urls(&self) -> Result<Vec<String>, UsageError> {
        let from_env = std::env::var("SWITCHYARD_CONTROL_PLANE")
            .ok()
            .filter(|value| !value.trim().is_empty());
        let (urls, origin) = if !self.control_plane.is_empty() {
            (self.control_plane.clone(), "--control-plane")
        } else if let Some(value) = from_env {
            (
                value.split(',').map(|url| url.trim().to_owned()).collect(),
                "$SWITCHYARD_CONTROL_PLANE",
            )
        } else {
            (vec!["http://127.0.0.1:50051".to_owned()], "--control-plane")
        };
        for url in &urls {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(UsageError(format!(
                    "{origin}: {url:?} must start with http:// or https://"
                )));
            }
            url.parse::<http::Uri>()
                .map_err(|err| UsageError(format!("{origin}: {url:?}: {err}")))?;
        }
        Ok(urls)
    }
}

#[derive(Debug, Clone)]
pub enum Source {
    ControlPlane(Vec<String>),
    Static(StaticConfig),
}

/// Every wait on the request path has one of these deadlines.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub connect: Duration,
    /// How long an idle upstream connection is kept for reuse.
    pub upstream_idle: Duration,
    pub client_header: Duration,
    pub client_body: Duration,
    pub upstream_header: Duration,
    pub stream_idle: Duration,
}

/// A validated router configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    pub config: RouterConfig,
    pub source: Source,
    pub tls_ca: Option<Vec<u8>>,
    pub control_plane_token: Option<String>,
    pub router_id: String,
    /// Serving threads (`--worker-threads`, resolved).
    pub worker_threads: usize,
    pub deadlines: Deadlines,
    pub limits: Limits,
    /// Flow control: the queues' bounds and whether clients' flow headers are trusted.
    pub queue: crate::request::queue::QueueSettings,
    /// OpenTelemetry traces, when on.
    pub telemetry: Option<TelemetrySettings>,
    /// KV_AWARE: the index's bounds and the subscribers' probes.
    pub kv: crate::kv::KvSettings,
    /// KV_AWARE: the deadline of a request's `/tokenize` round trip.
    pub kv_tokenize_timeout: Duration,
    /// KV_AWARE: the first pause of an instance whose `/tokenize` keeps failing.
    pub kv_tokenize_pause: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_take_binary_suffixes() {
        assert_eq!(parse_byte_size("1024"), Ok(1024));
        assert_eq!(parse_byte_size("256MiB"), Ok(256 << 20));
        assert_eq!(parse_byte_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_byte_size("64KiB"), Ok(64 << 10));
        assert!(
            parse_byte_size("1GB")
                .unwrap_err()
                .0
                .contains("unknown unit")
        );
        assert!(parse_byte_size("MiB").is_err());
        assert!(parse_byte_size("99999999999999999999GiB").is_err());
        assert!(
            parse_byte_size("20000000000GiB")
                .unwrap_err()
                .0
                .contains("too large")
        );
    }

    fn config() -> RouterConfig {
        RouterConfig::with_control_plane(
            "127.0.0.1:0".parse().unwrap(),
            vec!["http://127.0.0.1:1".into()],
        )
    }

    #[test]
    fn every_deadline_and_limit_is_checked_by_name() {
        let mut bad = config();
        bad.upstream_header_timeout_seconds = 0;
        assert!(
            bad.validate()
                .unwrap_err()
                .0
                .contains("--upstream-header-timeout-seconds")
        );
        let mut bad = config();
        bad.max_in_flight = 0;
        assert!(bad.validate().unwrap_err().0.contains("--max-in-flight"));
        let mut bad = config();
        bad.upstream_header_timeout_seconds = 2;
        assert!(
            bad.validate()
                .unwrap_err()
                .0
                .contains("--connect-timeout-ms")
        );
        let mut bad = config();
        bad.max_buffered_bytes = 1 << 20;
        assert!(
            bad.validate()
                .unwrap_err()
                .0
                .contains("--max-buffered-bytes")
        );
        let mut bad = config();
        bad.kv.kv_tokenize_timeout_ms = 0;
        assert!(
            bad.validate()
                .unwrap_err()
                .0
                .contains("--kv-tokenize-timeout-ms")
        );
        let settings = config().validate().unwrap();
        assert_eq!(settings.deadlines.stream_idle, Duration::from_secs(120));
        assert_eq!(settings.kv_tokenize_timeout, Duration::from_millis(250));
        assert_eq!(settings.kv_tokenize_pause, Duration::from_secs(1));
        let mut bad = config();
        bad.kv.kv_tokenize_pause_ms = 10;
        assert!(
            bad.validate()
                .unwrap_err()
                .0
                .contains("--kv-tokenize-pause-ms")
        );
        assert_eq!(settings.limits.max_buffered_bytes, 512 << 20);
    }

    #[test]
    fn the_defaults_of_with_control_plane_are_the_flag_defaults() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            config: RouterConfig,
        }
        let parsed = Cli::parse_from(["router", "--worker-threads", "1"]).config;
        let made = RouterConfig::with_control_plane(parsed.listen, parsed.control_plane.clone());
        assert_eq!(format!("{parsed:?}"), format!("{made:?}"));
    }
}
