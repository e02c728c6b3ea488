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
    /// With `keep`: the ASCII metadata of every export request received.
    metadata: Mutex<Vec<(String, String)>>,
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
        if self.0.keep {
            let metadata: Vec<(String, String)> = request
                .metadata()
                .iter()
                .filter_map(|entry| match entry {
                    tonic::metadata::KeyAndValueRef::Ascii(key, value) => {
                        Some((key.to_string(), value.to_str().ok()?.to_owned()))
                    }
                    tonic::metadata::KeyAndValueRef::Binary(..) => None,
                })
                .collect();
            self.0
                .metadata
                .lock()
                .unwrap_or_else(|poison| poison.into_inner())
                .extend(metadata);
        }
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
    /// (tests); otherwise only count them (benchmarks), reading no more of each export than
    /// its envelope: the sink shares the benchmark's cores with the router it measures, and a
    /// full decode costs about what the router's encode does.
    pub async fn start(keep: bool) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        Self::start_on(listener, keep)
    }

    /// [`OtlpSink::start`] on a listener of the caller's (a collector coming back on the
    /// address it had).
    pub fn start_on(listener: tokio::net::TcpListener, keep: bool) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let received = Arc::new(Received {
            keep,
            ..Received::default()
        });
        let stop = CancellationToken::new();
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let signal = stop.clone().cancelled_owned();
        let mut server = tonic::transport::Server::builder();
        let task = if keep {
            let service = TraceServiceServer::new(Receiver(Arc::clone(&received)));
            tokio::spawn(async move {
                let _ = server
                    .add_service(service)
                    .serve_with_incoming_shutdown(incoming, signal)
                    .await;
            })
        } else {
            let service = counting::CountingServer(Arc::clone(&received));
            tokio::spawn(async move {
                let _ = server
                    .add_service(service)
                    .serve_with_incoming_shutdown(incoming, signal)
                    .await;
            })
        };
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

    /// The metadata (name, value) of the export requests received so far (kept only).
    pub fn metadata(&self) -> Vec<(String, String)> {
        self.received
            .metadata
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .clone()
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

/// The counting receiver: the same OTLP/gRPC method, decoding only the nesting down to
/// each span (a span's own bytes are skipped, not parsed).
mod counting {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::task::{Context, Poll};

    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse;
    use tonic::codegen::{BoxFuture, Service, http};

    use super::Received;

    /// `ExportTraceServiceRequest`, down to the spans.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Envelope {
        #[prost(message, repeated, tag = "1")]
        pub resource_spans: Vec<ResourceSpans>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ResourceSpans {
        #[prost(message, repeated, tag = "2")]
        pub scope_spans: Vec<ScopeSpans>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ScopeSpans {
        /// Each span, unparsed.
        #[prost(bytes = "bytes", repeated, tag = "2")]
        pub spans: Vec<bytes::Bytes>,
    }

    #[derive(Debug, Clone)]
    pub struct CountingServer(pub Arc<Received>);

    impl tonic::server::NamedService for CountingServer {
        const NAME: &'static str = "opentelemetry.proto.collector.trace.v1.TraceService";
    }

    #[derive(Clone)]
    struct Export(Arc<Received>);

    impl tonic::server::UnaryService<Envelope> for Export {
        type Response = ExportTraceServiceResponse;
        type Future = BoxFuture<tonic::Response<Self::Response>, tonic::Status>;

        fn call(&mut self, request: tonic::Request<Envelope>) -> Self::Future {
            let spans: usize = request
                .get_ref()
                .resource_spans
                .iter()
                .flat_map(|resource| &resource.scope_spans)
                .map(|scope| scope.spans.len())
                .sum();
            self.0.count.fetch_add(spans as u64, Ordering::Relaxed);
            Box::pin(async {
                Ok(tonic::Response::new(ExportTraceServiceResponse {
                    partial_success: None,
                }))
            })
        }
    }

    impl<B> Service<http::Request<B>> for CountingServer
    where
        B: tonic::codegen::Body + Send + 'static,
        B::Error: Into<tonic::codegen::StdError> + Send + 'static,
    {
        type Response = http::Response<tonic::body::Body>;
        type Error = std::convert::Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;

        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<B>) -> Self::Future {
            let received = Arc::clone(&self.0);
            Box::pin(async move {
                if request.uri().path()
                    != "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
                {
                    return Ok(tonic::Status::unimplemented("only Export").into_http());
                }
                let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::<
                    ExportTraceServiceResponse,
                    Envelope,
                >::default());
                Ok(grpc.unary(Export(received), request).await)
            })
        }
    }
}
