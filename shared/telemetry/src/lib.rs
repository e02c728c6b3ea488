//! OpenTelemetry traces: the flags and `OTEL_*` variables that turn them on, the tracer
//! provider, the span queue that never blocks the caller, W3C propagation, and the OTLP/gRPC
//! encoder and exporter ([`otlp`]).
//!
//! Off (no `--otlp-endpoint`, no `OTEL_EXPORTER_OTLP_ENDPOINT`) nothing is built: no tracer,
//! no thread, no span. On, finished spans go into a bounded queue; one thread of its own
//! sends them in batches over OTLP/gRPC. When the queue is full (the collector is slow or
//! gone) a span is dropped and counted, never waited for.

pub mod otlp;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::Context;
use opentelemetry::trace::TraceId;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{
    Sampler, SdkTracer, SdkTracerProvider, Span, SpanData, SpanProcessor,
};
use switchyard_process::UsageError;

/// Spans sent in one export call at most: one call per few hundred requests at full load,
/// where one per 170 requests (512 spans) left the export thread behind at 16,000 requests/s.
const BATCH_SPANS: usize = 2048;
/// How long a batch waits for more spans before it is sent.
const BATCH_DELAY: Duration = Duration::from_millis(200);
/// A batch encoded larger than this is sent in halves (collectors commonly refuse requests
/// over 4 MiB).
const MAX_REQUEST_BYTES: usize = 3 << 20;
/// After a collector could not be reached, batches are dropped unsent for this long, then one
/// is tried.
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(1);
/// One export call's deadline.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

static SPANS_EXPORTED: AtomicU64 = AtomicU64::new(0);
static SPANS_DROPPED: AtomicU64 = AtomicU64::new(0);

/// Spans the collector accepted (`switchyard_trace_spans_exported_total`).
pub fn spans_exported() -> u64 {
    SPANS_EXPORTED.load(Ordering::Relaxed)
}

/// Spans dropped: the queue was full or the collector refused or missed a batch
/// (`switchyard_trace_spans_dropped_total`).
pub fn spans_dropped() -> u64 {
    SPANS_DROPPED.load(Ordering::Relaxed)
}

/// Writes the trace-export counters (every component's `/metrics` has them).
pub fn write_metrics(encoder: &mut switchyard_process::metrics::TextEncoder) {
    encoder
        .family(
            "switchyard_trace_spans_exported_total",
            "counter",
            "Spans sent to the OpenTelemetry collector and accepted.",
        )
        .sample(
            "switchyard_trace_spans_exported_total",
            &[],
            spans_exported() as f64,
        );
    encoder
        .family(
            "switchyard_trace_spans_dropped_total",
            "counter",
            "Spans dropped: the export queue was full, or the collector refused or missed a batch.",
        )
        .sample(
            "switchyard_trace_spans_dropped_total",
            &[],
            spans_dropped() as f64,
        );
}

/// Spans the export queue holds by default.
const QUEUE_SPANS: usize = 16384;

/// The tracing flags every server binary takes.
#[derive(Debug, Clone, clap::Args)]
pub struct TelemetryArgs {
    /// Send OpenTelemetry traces over OTLP/gRPC to this collector URL
    /// (e.g. http://127.0.0.1:4317). Off when unset. Sampling follows OTEL_TRACES_SAMPLER and
    /// OTEL_TRACES_SAMPLER_ARG (default parentbased_always_on); the service name
    /// OTEL_SERVICE_NAME.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_ENDPOINT",
        value_name = "URL",
        verbatim_doc_comment
    )]
    pub otlp_endpoint: Option<String>,
    /// Finished spans waiting for export at most (spans); past it spans are dropped and
    /// counted in switchyard_trace_spans_dropped_total.
    #[arg(long, default_value_t = QUEUE_SPANS, value_name = "SPANS")]
    pub otlp_queue_spans: usize,
}

impl Default for TelemetryArgs {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            otlp_queue_spans: QUEUE_SPANS,
        }
    }
}

/// Checked tracing settings; `None` when tracing is off.
#[derive(Debug, Clone)]
pub struct TelemetrySettings {
    pub endpoint: String,
    pub queue_spans: usize,
    pub sampler: SamplerSetting,
    /// `OTEL_SERVICE_NAME`, when set.
    pub service_name: Option<String>,
    /// gRPC metadata sent with every export: `OTEL_EXPORTER_OTLP_TRACES_HEADERS`, else
    /// `OTEL_EXPORTER_OTLP_HEADERS` (`key=value,key=value`, values percent-encoded).
    pub headers: Vec<(String, String)>,
}

/// Parses an OTLP headers variable (`name` for errors): `key=value` pairs separated by
/// commas, values percent-decoded; keys must be valid gRPC metadata names.
pub fn parse_otlp_headers(name: &str, text: &str) -> Result<Vec<(String, String)>, UsageError> {
    let mut headers = Vec::new();
    for pair in text
        .split(',')
        .map(str::trim)
        .filter(|pair| !pair.is_empty())
    {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| UsageError(format!("{name}: {pair:?} is not key=value")))?;
        let key = key.trim().to_ascii_lowercase();
        let value = percent_decode(value.trim()).ok_or_else(|| {
            UsageError(format!(
                "{name}: the value of {key:?} is not valid percent-encoding"
            ))
        })?;
        if tonic::metadata::MetadataKey::<tonic::metadata::Ascii>::from_bytes(key.as_bytes())
            .is_err()
            || key.ends_with("-bin")
        {
            return Err(UsageError(format!(
                "{name}: {key:?} is not a valid header name"
            )));
        }
        if tonic::metadata::MetadataValue::<tonic::metadata::Ascii>::try_from(value.as_str())
            .is_err()
        {
            return Err(UsageError(format!(
                "{name}: the value of {key:?} is not a valid header value"
            )));
        }
        headers.push((key, value));
    }
    Ok(headers)
}

fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] == b'%' {
            let hex = std::str::from_utf8(bytes.get(at + 1..at + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            at += 3;
        } else {
            out.push(bytes[at]);
            at += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// `OTEL_TRACES_SAMPLER` and its argument.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SamplerSetting {
    AlwaysOn,
    AlwaysOff,
    Ratio(f64),
    ParentBasedAlwaysOn,
    ParentBasedAlwaysOff,
    ParentBasedRatio(f64),
}

impl SamplerSetting {
    /// Reads the standard variables' values; the error names the variable.
    pub fn parse(sampler: Option<&str>, arg: Option<&str>) -> Result<Self, UsageError> {
        let ratio = || -> Result<f64, UsageError> {
            let Some(arg) = arg else { return Ok(1.0) };
            match arg.trim().parse::<f64>() {
                Ok(ratio) if (0.0..=1.0).contains(&ratio) => Ok(ratio),
                _ => Err(UsageError(format!(
                    "OTEL_TRACES_SAMPLER_ARG: {arg:?} is not a ratio between 0 and 1"
                ))),
            }
        };
        Ok(
            match sampler.map(str::trim).unwrap_or("parentbased_always_on") {
                "always_on" => Self::AlwaysOn,
                "always_off" => Self::AlwaysOff,
                "traceidratio" => Self::Ratio(ratio()?),
                "parentbased_always_on" | "" => Self::ParentBasedAlwaysOn,
                "parentbased_always_off" => Self::ParentBasedAlwaysOff,
                "parentbased_traceidratio" => Self::ParentBasedRatio(ratio()?),
                other => {
                    return Err(UsageError(format!(
                        "OTEL_TRACES_SAMPLER: {other:?} is not one of always_on, always_off, \
                     traceidratio, parentbased_always_on, parentbased_always_off, \
                     parentbased_traceidratio"
                    )));
                }
            },
        )
    }

    fn sampler(self) -> Sampler {
        match self {
            Self::AlwaysOn => Sampler::AlwaysOn,
            Self::AlwaysOff => Sampler::AlwaysOff,
            Self::Ratio(ratio) => Sampler::TraceIdRatioBased(ratio),
            Self::ParentBasedAlwaysOn => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
            Self::ParentBasedAlwaysOff => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
            Self::ParentBasedRatio(ratio) => {
                Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio)))
            }
        }
    }
}

impl SamplerSetting {
    /// The SDK's decision for this setting, made without it: parent-based settings follow a
    /// valid parent's sampled flag; a ratio compares the trace id's low 8 bytes, halved, with
    /// ratio × 2^63 (OpenTelemetry's TraceIdRatioBased).
    pub fn samples(
        self,
        parent: Option<&opentelemetry::trace::SpanContext>,
        trace_id: TraceId,
    ) -> bool {
        let ratio = |ratio: f64| {
            let bound = (ratio.clamp(0.0, 1.0) * (1u64 << 63) as f64) as u64;
            let bytes = trace_id.to_bytes();
            let low = u64::from_be_bytes([
                bytes[8], bytes[9], bytes[10], bytes[11], bytes[12], bytes[13], bytes[14],
                bytes[15],
            ]);
            (low >> 1) < bound
        };
        let parent = parent.filter(|parent| parent.is_valid());
        match self {
            Self::AlwaysOn => true,
            Self::AlwaysOff => false,
            Self::Ratio(r) => ratio(r),
            Self::ParentBasedAlwaysOn => parent.is_none_or(|parent| parent.is_sampled()),
            Self::ParentBasedAlwaysOff => parent.is_some_and(|parent| parent.is_sampled()),
            Self::ParentBasedRatio(r) => match parent {
                Some(parent) => parent.is_sampled(),
                None => ratio(r),
            },
        }
    }
}

impl TelemetryArgs {
    /// Checks the flags and the `OTEL_*` variables; `Ok(None)` when tracing is off.
    pub fn validate(&self) -> Result<Option<TelemetrySettings>, UsageError> {
        let endpoint = match self.otlp_endpoint.as_deref().map(str::trim) {
            None | Some("") => return Ok(None),
            Some(endpoint) => endpoint,
        };
        let uri: http::Uri = endpoint
            .parse()
            .map_err(|err| UsageError(format!("--otlp-endpoint {endpoint:?}: {err}")))?;
        if uri.scheme_str() == Some("https") {
            return Err(UsageError(format!(
                "--otlp-endpoint {endpoint:?}: TLS to the collector is not supported; export over \
                 http:// to a Collector or agent beside the process, which can forward over TLS"
            )));
        }
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(UsageError(format!(
                "--otlp-endpoint {endpoint:?}: expected http://HOST:PORT"
            )));
        }
        switchyard_process::check_range("--otlp-queue-spans", self.otlp_queue_spans, 1..=1 << 20)?;
        let variable = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let sampler = SamplerSetting::parse(
            variable("OTEL_TRACES_SAMPLER").as_deref(),
            variable("OTEL_TRACES_SAMPLER_ARG").as_deref(),
        )?;
        let headers = match variable("OTEL_EXPORTER_OTLP_TRACES_HEADERS") {
            Some(text) => parse_otlp_headers("OTEL_EXPORTER_OTLP_TRACES_HEADERS", &text)?,
            None => match variable("OTEL_EXPORTER_OTLP_HEADERS") {
                Some(text) => parse_otlp_headers("OTEL_EXPORTER_OTLP_HEADERS", &text)?,
                None => Vec::new(),
            },
        };
        Ok(Some(TelemetrySettings {
            endpoint: endpoint.to_owned(),
            queue_spans: self.otlp_queue_spans,
            sampler,
            service_name: variable("OTEL_SERVICE_NAME"),
            headers,
        }))
    }
}

/// A running tracer: its provider (shut down to flush) and a tracer to start spans with.
#[derive(Debug, Clone)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    pub tracer: SdkTracer,
    /// The same queue, for spans made without the SDK's span objects (the router's).
    pub sink: SpanSink,
}

/// Hands finished spans straight to the export queue, for a hot path that makes its spans
/// itself rather than through the SDK's tracer: the router's three spans a request cost more
/// as SDK objects (a builder, a context, a locked span, a sampler call each) than the routing
/// they trace. Cloning is cheap.
#[derive(Debug, Clone)]
pub struct SpanSink {
    queue: Arc<SpanQueue>,
    scope: opentelemetry::InstrumentationScope,
    sampler: SamplerSetting,
}

impl SpanSink {
    /// Queues a finished span (dropped if it is not sampled).
    pub fn push(&self, span: SpanData) {
        if span.span_context.is_sampled() {
            self.queue.push(span);
        }
    }

    /// The component's instrumentation scope, for [`SpanData::instrumentation_scope`].
    pub fn scope(&self) -> &opentelemetry::InstrumentationScope {
        &self.scope
    }

    /// True while the collector cannot be reached and spans are dropped unsent: a span need
    /// not be made, only counted with [`SpanSink::dropped`].
    pub fn resting(&self) -> bool {
        self.queue.resting()
    }

    /// Counts spans dropped without being made.
    pub fn dropped(&self, spans: u64) {
        SPANS_DROPPED.fetch_add(spans, Ordering::Relaxed);
    }

    /// Whether a span of trace `trace_id` under `parent` (a remote or local parent's context,
    /// if any) is sampled: the same decision as the SDK's sampler of this setting.
    pub fn samples(
        &self,
        parent: Option<&opentelemetry::trace::SpanContext>,
        trace_id: TraceId,
    ) -> bool {
        self.sampler.samples(parent, trace_id)
    }
}

/// Why tracing did not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("cannot start the trace export thread: {0}")]
    Thread(std::io::Error),
}

impl Telemetry {
    /// The layer that turns this project's own `tracing` spans into OpenTelemetry spans (only
    /// `switchyard*` targets: not its libraries', nor the exporter's own gRPC client's), for
    /// `switchyard_process::init_logging_with`.
    pub fn span_layer(
        &self,
    ) -> impl tracing_subscriber::Layer<switchyard_process::LogSubscriber> + Send + Sync + 'static
    {
        use tracing_subscriber::Layer as _;
        tracing_opentelemetry::layer()
            .with_tracer(self.tracer.clone())
            .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
                meta.target().starts_with("switchyard")
            }))
    }

    /// Starts the export thread and the tracer provider. `component` names the service
    /// unless `OTEL_SERVICE_NAME` does.
    pub fn start(
        settings: &TelemetrySettings,
        component: &'static str,
    ) -> Result<Self, TelemetryError> {
        let processor = QueueProcessor::start(
            settings.endpoint.clone(),
            settings.headers.clone(),
            settings.queue_spans,
        )?;
        let sink = SpanSink {
            queue: Arc::clone(&processor.queue),
            scope: opentelemetry::InstrumentationScope::builder(component).build(),
            sampler: settings.sampler,
        };
        let service = settings
            .service_name
            .clone()
            .unwrap_or_else(|| component.to_owned());
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(service)
            .build();
        let provider = SdkTracerProvider::builder()
            .with_sampler(settings.sampler.sampler())
            .with_span_processor(processor)
            .with_resource(resource)
            .build();
        // A static name: every span's scope is a copy of it.
        let tracer = provider.tracer(component);
        Ok(Self {
            provider,
            tracer,
            sink,
        })
    }

    /// Sends what is queued (within about two seconds) and stops the export thread.
    pub fn shutdown(&self) {
        let _ = self.provider.shutdown_with_timeout(Duration::from_secs(2));
    }
}

/// W3C trace context (`traceparent`, `tracestate`) in HTTP headers or gRPC metadata.
pub mod propagation {
    use http::{HeaderMap, HeaderName, HeaderValue};
    use opentelemetry::Context;
    use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
    use opentelemetry_sdk::propagation::TraceContextPropagator;

    pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
    pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

    struct Headers<'a>(&'a HeaderMap);

    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|value| value.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(HeaderName::as_str).collect()
        }
    }

    struct HeadersMut<'a>(&'a mut HeaderMap);

    impl Injector for HeadersMut<'_> {
        fn set(&mut self, key: &str, value: String) {
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(key.as_bytes()),
                HeaderValue::from_str(&value),
            ) {
                self.0.insert(name, value);
            }
        }
    }

    /// The remote parent the headers carry (an empty context when they carry none or a
    /// malformed one).
    pub fn extract(headers: &HeaderMap) -> Context {
        TraceContextPropagator::new().extract(&Headers(headers))
    }

    /// Replaces the headers' trace context with `cx`'s span: W3C `traceparent` (version 00)
    /// written straight into its header value, and `tracestate` when there is one. Nothing
    /// when `cx` has no valid span.
    pub fn inject(cx: &Context, headers: &mut HeaderMap) {
        use opentelemetry::trace::TraceContextExt as _;
        inject_span_context(cx.span().span_context(), headers);
    }

    /// [`inject`] for a span's context alone.
    pub fn inject_span_context(
        context: &opentelemetry::trace::SpanContext,
        headers: &mut HeaderMap,
    ) {
        headers.remove(TRACEPARENT);
        headers.remove(TRACESTATE);
        if !context.is_valid() {
            return;
        }
        // 00-{trace id: 32 hex}-{span id: 16 hex}-{flags: 2 hex}
        let mut text = [0u8; 55];
        text[..3].copy_from_slice(b"00-");
        hex_into(&context.trace_id().to_bytes(), &mut text[3..35]);
        text[35] = b'-';
        hex_into(&context.span_id().to_bytes(), &mut text[36..52]);
        text[52] = b'-';
        hex_into(&[context.trace_flags().to_u8()], &mut text[53..55]);
        if let Ok(value) = HeaderValue::from_bytes(&text) {
            headers.insert(TRACEPARENT, value);
        }
        let state = context.trace_state().header();
        if !state.is_empty() {
            HeadersMut(headers).set(TRACESTATE.as_str(), state);
        }
    }

    /// Lowercase hex of `bytes` into `out` (twice as long).
    fn hex_into(bytes: &[u8], out: &mut [u8]) {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        for (byte, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
            pair[0] = DIGITS[usize::from(byte >> 4)];
            pair[1] = DIGITS[usize::from(byte & 0x0f)];
        }
    }
}

/// Finished spans waiting for the export thread. `on_end` pushes under a short lock and
/// never wakes the thread, except when a whole batch is waiting: waking it for each span
/// (a channel send) cost the serving threads one `eventfd` write and a context switch per
/// span, more than making the span.
#[derive(Debug)]
struct SpanQueue {
    spans: Mutex<Vec<SpanData>>,
    /// The bound on spans held: queued, plus taken by the export thread and not yet sent.
    capacity: usize,
    /// Spans the export thread has taken and not yet sent or dropped.
    exporting: std::sync::atomic::AtomicUsize,
    /// A batch is waiting, or the queue is closing.
    ready: tokio::sync::Notify,
    closed: AtomicBool,
    /// Until when (milliseconds since the Unix epoch; 0: not) the collector is taken to be
    /// unreachable: batches are dropped unsent, so spans need not be made
    /// ([`SpanSink::resting`]). A deadline, not a flag: with no spans made meanwhile, no batch
    /// would come to lift a flag.
    resting_until_ms: AtomicU64,
}

impl SpanQueue {
    /// Takes what is queued, leaving an empty queue; counted against the bound until
    /// [`SpanQueue::done`].
    fn take(&self, spare: &mut Vec<SpanData>) {
        let mut spans = lock(&self.spans);
        std::mem::swap(&mut *spans, spare);
        self.exporting.fetch_add(spare.len(), Ordering::AcqRel);
    }

    fn resting(&self) -> bool {
        let until = self.resting_until_ms.load(Ordering::Acquire);
        until != 0 && switchyard_process::clock::unix_ms() < until
    }

    /// `count` taken spans are sent or dropped.
    fn done(&self, count: usize) {
        self.exporting.fetch_sub(count, Ordering::AcqRel);
    }

    /// Queues a finished, sampled span, or drops it (counted) when the queue is full or
    /// closed. Never waits.
    fn push(&self, span: SpanData) {
        if self.closed.load(Ordering::Acquire) {
            SPANS_DROPPED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let queued = {
            let mut spans = lock(&self.spans);
            let held = spans.len() + self.exporting.load(Ordering::Acquire);
            if held < self.capacity {
                spans.push(span);
                Some(spans.len())
            } else {
                None
            }
        };
        match queued {
            // The first span past a whole batch wakes the thread; the rest wait for it.
            Some(queued) if queued == BATCH_SPANS.min(self.capacity) => {
                self.ready.notify_one();
            }
            Some(_) => {}
            None => {
                SPANS_DROPPED.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// A batching span processor with a bounded queue: `on_end` never waits. A thread of its
/// own (a single-threaded runtime) sends batches with the OTLP/gRPC exporter, one at a time,
/// when a batch is full or every [`BATCH_DELAY`].
#[derive(Debug)]
struct QueueProcessor {
    queue: Arc<SpanQueue>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The provider's resource (service name), for the exporter to send with the spans.
    resource: Arc<Mutex<Option<Resource>>>,
}

impl QueueProcessor {
    fn start(
        endpoint: String,
        headers: Vec<(String, String)>,
        capacity: usize,
    ) -> Result<Self, TelemetryError> {
        let queue = Arc::new(SpanQueue {
            spans: Mutex::new(Vec::with_capacity(capacity.min(BATCH_SPANS))),
            capacity,
            exporting: std::sync::atomic::AtomicUsize::new(0),
            ready: tokio::sync::Notify::new(),
            closed: AtomicBool::new(false),
            resting_until_ms: AtomicU64::new(0),
        });
        let resource = Arc::new(Mutex::new(None));
        let pending = Arc::clone(&resource);
        let drained = Arc::clone(&queue);
        let thread = std::thread::Builder::new()
            .name("otlp-export".into())
            .spawn(move || export_loop(endpoint, headers, drained, pending))
            .map_err(TelemetryError::Thread)?;
        Ok(Self {
            queue,
            thread: Mutex::new(Some(thread)),
            resource,
        })
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl SpanProcessor for QueueProcessor {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if span.span_context.is_sampled() {
            self.queue.push(span);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn set_resource(&mut self, resource: &Resource) {
        *lock(&self.resource) = Some(resource.clone());
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        // Closing the queue lets the thread send what is left and stop.
        self.queue.closed.store(true, Ordering::Release);
        self.queue.ready.notify_one();
        let Some(thread) = lock(&self.thread).take() else {
            return Ok(());
        };
        let deadline = std::time::Instant::now() + timeout;
        while !thread.is_finished() {
            if std::time::Instant::now() >= deadline {
                return Err(OTelSdkError::Timeout(timeout));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = thread.join();
        Ok(())
    }
}

fn export_loop(
    endpoint: String,
    headers: Vec<(String, String)>,
    queue: Arc<SpanQueue>,
    resource: Arc<Mutex<Option<Resource>>>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            tracing::error!(error = %err, "cannot start the trace export runtime; spans are dropped");
            let mut spare = Vec::new();
            while !queue.closed.load(Ordering::Acquire) {
                std::thread::sleep(BATCH_DELAY);
                queue.take(&mut spare);
                SPANS_DROPPED.fetch_add(spare.len() as u64, Ordering::Relaxed);
                queue.done(spare.len());
                spare.clear();
            }
            return;
        }
    };
    runtime.block_on(async move {
        let mut client = match crate::otlp::Client::new(&endpoint, &headers, EXPORT_TIMEOUT) {
            Ok(client) => Some(client),
            Err(err) => {
                tracing::error!(error = %err, endpoint, "cannot make the OTLP client; spans are dropped");
                None
            }
        };
        let mut current_resource: Option<Resource> = None;
        let mut failing = false;
        let mut retry_at: Option<tokio::time::Instant> = None;
        let mut taken = Vec::new();
        let mut encoded = Vec::new();
        loop {
            // A whole batch, or the delay, or the end.
            let _ = tokio::time::timeout(BATCH_DELAY, queue.ready.notified()).await;
            let closing = queue.closed.load(Ordering::Acquire);
            queue.take(&mut taken);
            if let Some(resource) = lock(&resource).take() {
                current_resource = Some(resource);
            }
            let mut batches: Vec<&[SpanData]> = taken.chunks(BATCH_SPANS).rev().collect();
            while let Some(batch) = batches.pop() {
                let spans = batch.len() as u64;
                // After a collector could not be reached, batches are dropped unsent until
                // the next try: encoding spans for a collector that is gone costs as much as
                // sending them.
                let resting = retry_at.is_some_and(|at| tokio::time::Instant::now() < at);
                let sent = match &mut client {
                    Some(_) if resting => Err(crate::otlp::Failed::unreachable(String::new())),
                    Some(client) => {
                        crate::otlp::encode_request(current_resource.as_ref(), batch, &mut encoded);
                        if encoded.len() > MAX_REQUEST_BYTES && batch.len() > 1 {
                            // Too large for collectors' usual 4 MiB limit: in halves.
                            let (first, second) = batch.split_at(batch.len() / 2);
                            batches.extend([second, first]);
                            continue;
                        }
                        let body = bytes::Bytes::copy_from_slice(&encoded);
                        match tokio::time::timeout(EXPORT_TIMEOUT, client.export(body)).await {
                            Ok(result) => result,
                            Err(_) => Err(crate::otlp::Failed::unreachable("timed out".into())),
                        }
                    }
                    None => Err(crate::otlp::Failed::refused("no exporter".into())),
                };
                match sent {
                    Ok(sent) => {
                        let rejected = match sent {
                            crate::otlp::Sent::All => 0,
                            crate::otlp::Sent::Partly { rejected, reason } => {
                                let rejected = rejected.min(spans);
                                tracing::debug!(endpoint, rejected, reason, "the collector rejected spans");
                                rejected
                            }
                        };
                        SPANS_EXPORTED.fetch_add(spans - rejected, Ordering::Relaxed);
                        SPANS_DROPPED.fetch_add(rejected, Ordering::Relaxed);
                        retry_at = None;
                        queue.resting_until_ms.store(0, Ordering::Release);
                        if std::mem::take(&mut failing) {
                            tracing::info!(endpoint, "trace export works again");
                        }
                    }
                    Err(_) if resting => {
                        SPANS_DROPPED.fetch_add(spans, Ordering::Relaxed);
                    }
                    Err(failed) => {
                        SPANS_DROPPED.fetch_add(spans, Ordering::Relaxed);
                        // Only a collector that cannot be reached rests the export; one that
                        // refuses a batch (too large, unauthenticated) is asked with the next.
                        if failed.unreachable {
                            retry_at = Some(tokio::time::Instant::now() + RETRY_AFTER_FAILURE);
                            queue.resting_until_ms.store(
                                switchyard_process::clock::unix_ms() + RETRY_AFTER_FAILURE.as_millis() as u64,
                                Ordering::Release,
                            );
                        }
                        if !std::mem::replace(&mut failing, true) {
                            tracing::warn!(endpoint, error = failed.message, spans, "trace export failed; spans are dropped until the collector answers");
                        }
                    }
                }
            }
            queue.done(taken.len());
            taken.clear();
            if closing {
                // What arrived while the last batches were sent is dropped and counted.
                queue.take(&mut taken);
                SPANS_DROPPED.fetch_add(taken.len() as u64, Ordering::Relaxed);
                queue.done(taken.len());
                break;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samplers_follow_the_standard_names() {
        assert_eq!(
            SamplerSetting::parse(None, None),
            Ok(SamplerSetting::ParentBasedAlwaysOn)
        );
        assert_eq!(
            SamplerSetting::parse(Some("parentbased_traceidratio"), Some("0.25")),
            Ok(SamplerSetting::ParentBasedRatio(0.25))
        );
        assert_eq!(
            SamplerSetting::parse(Some("always_off"), None),
            Ok(SamplerSetting::AlwaysOff)
        );
        let err = SamplerSetting::parse(Some("sometimes"), None).unwrap_err();
        assert!(err.0.starts_with("OTEL_TRACES_SAMPLER:"), "{err}");
        let err = SamplerSetting::parse(Some("traceidratio"), Some("2")).unwrap_err();
        assert!(err.0.starts_with("OTEL_TRACES_SAMPLER_ARG:"), "{err}");
    }

    #[test]
    fn otlp_headers_are_key_value_pairs_with_percent_encoded_values() {
        assert_eq!(
            parse_otlp_headers("V", "Authorization=Bearer%20abc, x-tenant = t1,"),
            Ok(vec![
                ("authorization".to_owned(), "Bearer abc".to_owned()),
                ("x-tenant".to_owned(), "t1".to_owned()),
            ])
        );
        assert_eq!(parse_otlp_headers("V", ""), Ok(Vec::new()));
        for bad in [
            "novalue",
            "a b=1",
            "k=%zz",
            "k=%4",
            "bin-bin=x",
            "k=line%0Abreak",
        ] {
            let err = parse_otlp_headers("V", bad).unwrap_err();
            assert!(err.0.starts_with("V: "), "{bad}: {err}");
        }
    }

    #[test]
    fn sampling_decisions_are_the_sdks() {
        use opentelemetry::trace::{
            SpanContext, SpanId, SpanKind, TraceContextExt as _, TraceFlags, TraceState,
        };
        use opentelemetry_sdk::trace::{SamplingDecision, ShouldSample as _};
        let mut rng = fastrand::Rng::with_seed(7);
        let settings = [
            SamplerSetting::AlwaysOn,
            SamplerSetting::AlwaysOff,
            SamplerSetting::Ratio(0.25),
            SamplerSetting::ParentBasedAlwaysOn,
            SamplerSetting::ParentBasedAlwaysOff,
            SamplerSetting::ParentBasedRatio(0.5),
            SamplerSetting::ParentBasedRatio(0.0),
            SamplerSetting::Ratio(1.0),
        ];
        for setting in settings {
            let sdk = setting.sampler();
            let mut sampled = 0;
            for round in 0..2_000 {
                let trace_id = TraceId::from(rng.u128(1..));
                let parent = match round % 3 {
                    0 => None,
                    flags => Some(SpanContext::new(
                        trace_id,
                        SpanId::from(rng.u64(1..)),
                        if flags == 1 {
                            TraceFlags::SAMPLED
                        } else {
                            TraceFlags::default()
                        },
                        true,
                        TraceState::default(),
                    )),
                };
                let cx = parent
                    .clone()
                    .map(|parent| Context::new().with_remote_span_context(parent));
                let expected =
                    sdk.should_sample(cx.as_ref(), trace_id, "s", &SpanKind::Server, &[], &[]);
                let ours = setting.samples(parent.as_ref(), trace_id);
                assert_eq!(
                    ours,
                    expected.decision == SamplingDecision::RecordAndSample,
                    "{setting:?} round {round}"
                );
                sampled += usize::from(ours);
            }
            // The draws reach both outcomes where the setting allows both.
            if !matches!(
                setting,
                SamplerSetting::AlwaysOn | SamplerSetting::AlwaysOff | SamplerSetting::Ratio(1.0)
            ) {
                assert!(sampled > 0 && sampled < 2_000, "{setting:?}: {sampled}");
            }
        }
    }

    /// Why `--otlp-endpoint` `endpoint` is refused.
    fn refusal_of(endpoint: &str) -> UsageError {
        let args = TelemetryArgs {
            otlp_endpoint: Some(endpoint.into()),
            otlp_queue_spans: 16,
        };
        args.validate().unwrap_err()
    }

    #[test]
    fn https_is_refused_with_a_reason() {
        let err = refusal_of("https://collector:4317");
        assert!(
            err.0.contains("TLS to the collector is not supported"),
            "{err}"
        );
    }

    #[test]
    fn the_endpoint_must_be_a_url() {
        let err = refusal_of("localhost:4317");
        assert!(err.0.starts_with("--otlp-endpoint"), "{err}");
        let off = TelemetryArgs::default();
        assert!(off.validate().unwrap().is_none());
    }

    #[test]
    fn trace_context_is_replaced_not_appended() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            propagation::TRACEPARENT,
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
                .parse()
                .unwrap(),
        );
        headers.insert(propagation::TRACESTATE, "vendor=1".parse().unwrap());
        let cx = propagation::extract(&headers);
        use opentelemetry::trace::TraceContextExt as _;
        let remote = cx.span().span_context().clone();
        assert_eq!(
            remote.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        let mut out = headers.clone();
        propagation::inject(&cx, &mut out);
        assert_eq!(out.get_all(propagation::TRACEPARENT).iter().count(), 1);
        assert_eq!(out.get(propagation::TRACESTATE).unwrap(), "vendor=1");
    }

    #[test]
    fn injected_trace_context_is_what_the_sdk_propagator_writes() {
        use opentelemetry::propagation::TextMapPropagator as _;
        use opentelemetry::trace::{
            SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
        };
        use std::collections::HashMap;
        for (flags, state) in [
            (TraceFlags::SAMPLED, TraceState::default()),
            (
                TraceFlags::default(),
                TraceState::from_key_value([("k", "v"), ("a", "1")]).unwrap(),
            ),
        ] {
            let context = SpanContext::new(
                TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
                SpanId::from_hex("00f067aa0ba902b7").unwrap(),
                flags,
                true,
                state,
            );
            let cx = Context::new().with_remote_span_context(context);
            let mut ours = http::HeaderMap::new();
            propagation::inject(&cx, &mut ours);
            let mut sdk = HashMap::new();
            opentelemetry_sdk::propagation::TraceContextPropagator::new()
                .inject_context(&cx, &mut sdk);
            // The SDK writes an empty `tracestate`; W3C lets it be left out, and we do.
            sdk.retain(|_, value: &mut String| !value.is_empty());
            assert_eq!(ours.len(), sdk.len(), "{ours:?} {sdk:?}");
            for (name, value) in &sdk {
                assert_eq!(ours.get(name.as_str()).unwrap(), value.as_str(), "{name}");
            }
        }
        // No valid span: nothing, and what the headers carried is gone.
        let mut headers = http::HeaderMap::new();
        headers.insert(propagation::TRACEPARENT, "stale".parse().unwrap());
        propagation::inject(&Context::new(), &mut headers);
        assert!(headers.is_empty(), "{headers:?}");
    }
}
