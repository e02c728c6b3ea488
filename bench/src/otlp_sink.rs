//! An OTLP/gRPC trace receiver on loopback (the `opentelemetry-proto` crate's tonic service):
//! the collector stand-in for the tracing tests and the overhead benchmark. It accepts every
//! export; with `keep` it also holds the spans for a test to read.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// One span as received, ids in lowercase hex (an empty parent: a root span).
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub service: String,
    pub name: String,
    /// OTLP's `SpanKind`: 1 internal, 2 server, 3 client.
    pub kind: i32,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    /// Attribute values as text.
    pub attributes: BTreeMap<String, String>,
}

impl ReceivedSpan {
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

#[derive(Debug, Default)]
struct Received {
    keep: bool,
    spans: Mutex<Vec<ReceivedSpan>>,
    count: AtomicU64,
}

#[derive(Debug, Clone)]
struct Receiver(Arc<Received>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let request = request.into_inner();
        let mut received = Vec::new();
        for resource_spans in request.resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|resource| &resource.attributes)
                .find(|attribute| attribute.key == "service.name")
                .and_then(|attribute| attribute.value.as_ref())
                .map(|value| text(value.value.as_ref()))
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    self.0.count.fetch_add(1, Ordering::Relaxed);
                    if !self.0.keep {
                        continue;
                    }
                    received.push(ReceivedSpan {
                        service: service.clone(),
                        name: span.name,
                        kind: span.kind,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        attributes: span
                            .attributes
                            .into_iter()
                            .map(|attribute| {
                                let value = attribute
                                    .value
                                    .as_ref()
                                    .map(|value| text(value.value.as_ref()))
                                    .unwrap_or_default();
                                (attribute.key, value)
                            })
                            .collect(),
                    });
                }
            }
        }
        if !received.is_empty() {
            self.0
                .spans
                .lock()
                .unwrap_or_else(|poison| poison.into_inner())
                .extend(received);
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn text(value: Option<&Value>) -> String {
    match value {
        Some(Value::StringValue(text)) => text.clone(),
        Some(Value::IntValue(number)) => number.to_string(),
        Some(Value::BoolValue(flag)) => flag.to_string(),
        Some(Value::DoubleValue(number)) => number.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

/// A running receiver; stopped when dropped.
#[derive(Debug)]
pub struct OtlpSink {
    pub addr: SocketAddr,
    received: Arc<Received>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl OtlpSink {
    /// Listens on 127.0.0.1 (any free port). `keep`: hold the spans for [`OtlpSink::spans`]
    /// (tests); otherwise only count them (benchmarks).
    pub async fn start(keep: bool) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let received = Arc::new(Received {
            keep,
            ..Received::default()
        });
        let stop = CancellationToken::new();
        let service = TraceServiceServer::new(Receiver(Arc::clone(&received)));
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let signal = stop.clone().cancelled_owned();
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, signal)
                .await;
        });
        Ok(Self {
            addr,
            received,
            stop,
            task,
        })
    }

    /// The URL for `--otlp-endpoint`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Spans received so far (kept or not).
    pub fn count(&self) -> u64 {
        self.received.count.load(Ordering::Relaxed)
    }

    /// The spans kept so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.received
            .spans
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone()
    }
}

impl Drop for OtlpSink {
    fn drop(&mut self) {
        self.stop.cancel();
        self.task.abort();
    }
}
