//! OTLP/gRPC trace export without the intermediate message tree: finished spans are written
//! straight from the SDK's [`SpanData`] into the protobuf bytes of one
//! `ExportTraceServiceRequest` (opentelemetry/proto/collector/trace/v1), which is sent as is.
//!
//! The SDK's exporter first builds `opentelemetry-proto` structs (a `String` or `Vec` for every
//! id, name, key and value of every span), groups them in a map, encodes them, and frees
//! them all: at full load that cost the router more CPU than the routing it traced. Here a
//! batch is one buffer, reused. `tests` checks the bytes against `opentelemetry-proto`'s
//! decoding of what the SDK's own conversion produces.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::trace::{SpanKind, Status};
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SpanData;

/// The gRPC method OTLP collectors serve.
const EXPORT_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

/// Protobuf writing over a `Vec<u8>`.
struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn varint(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.0.push((value as u8) | 0x80);
            value >>= 7;
        }
        self.0.push(value as u8);
    }

    fn tag(&mut self, field: u32, wire: u32) {
        self.varint(u64::from((field << 3) | wire));
    }

    fn bytes(&mut self, field: u32, bytes: &[u8]) {
        self.tag(field, LEN);
        self.varint(bytes.len() as u64);
        self.0.extend_from_slice(bytes);
    }

    /// A string or bytes field, left out when empty (proto3's default).
    fn bytes_if_any(&mut self, field: u32, bytes: &[u8]) {
        if !bytes.is_empty() {
            self.bytes(field, bytes);
        }
    }

    fn uint(&mut self, field: u32, value: u64) {
        if value != 0 {
            self.tag(field, VARINT);
            self.varint(value);
        }
    }

    fn fixed64(&mut self, field: u32, value: u64) {
        if value != 0 {
            self.tag(field, FIXED64);
            self.0.extend_from_slice(&value.to_le_bytes());
        }
    }

    fn fixed32(&mut self, field: u32, value: u32) {
        if value != 0 {
            self.tag(field, FIXED32);
            self.0.extend_from_slice(&value.to_le_bytes());
        }
    }

    /// A nested message: one byte is kept for its length, its content written after it,
    /// and the length put in that byte; a content of 128 bytes or more moves by the length's
    /// further bytes (most messages, an attribute or a value, are shorter).
    fn message(&mut self, field: u32, write: impl FnOnce(&mut Writer<'_>)) {
        self.tag(field, LEN);
        let start = self.0.len();
        self.0.push(0);
        write(&mut Writer(self.0));
        let length = self.0.len() - start - 1;
        if length < 0x80 {
            self.0[start] = length as u8;
            return;
        }
        let mut prefix = [0u8; 10];
        let mut used = 0;
        let mut value = length as u64;
        while value >= 0x80 {
            prefix[used] = (value as u8) | 0x80;
            value >>= 7;
            used += 1;
        }
        prefix[used] = value as u8;
        used += 1;
        self.0[start] = prefix[0];
        self.0
            .splice(start + 1..start + 1, prefix[1..used].iter().copied());
    }

    fn key_value(&mut self, field: u32, key: &str, value: &Value) {
        self.message(field, |w| {
            w.bytes_if_any(1, key.as_bytes());
            w.message(2, |w| w.any_value(value));
        });
    }

    /// `AnyValue`: 1 string, 2 bool, 3 int, 4 double, 5 array.
    fn any_value(&mut self, value: &Value) {
        use opentelemetry::Array;
        match value {
            Value::String(text) => self.bytes(1, text.as_str().as_bytes()),
            Value::Bool(flag) => {
                self.tag(2, VARINT);
                self.varint(u64::from(*flag));
            }
            Value::I64(number) => {
                self.tag(3, VARINT);
                self.varint(*number as u64);
            }
            Value::F64(number) => {
                self.tag(4, FIXED64);
                self.0.extend_from_slice(&number.to_le_bytes());
            }
            Value::Array(array) => self.message(5, |w| match array {
                Array::Bool(items) => items
                    .iter()
                    .for_each(|item| w.message(1, |w| w.any_value(&Value::Bool(*item)))),
                Array::I64(items) => items
                    .iter()
                    .for_each(|item| w.message(1, |w| w.any_value(&Value::I64(*item)))),
                Array::F64(items) => items
                    .iter()
                    .for_each(|item| w.message(1, |w| w.any_value(&Value::F64(*item)))),
                Array::String(items) => items.iter().for_each(|item| {
                    w.message(1, |w| w.bytes(1, item.as_str().as_bytes()));
                }),
                _ => {}
            }),
            // A kind this encoder does not know: its text.
            other => self.bytes(1, other.to_string().as_bytes()),
        }
    }

    fn attributes(&mut self, field: u32, attributes: &[KeyValue]) {
        for attribute in attributes {
            self.key_value(field, attribute.key.as_str(), &attribute.value);
        }
    }
}

fn nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_nanos()
        .try_into()
        .unwrap_or(u64::MAX)
}

/// `Span.flags`: the W3C trace flags, and whether the parent is known to be remote.
fn span_flags(trace_flags: u8, remote: bool) -> u32 {
    const HAS_IS_REMOTE: u32 = 0x100;
    const IS_REMOTE: u32 = 0x200;
    u32::from(trace_flags) | HAS_IS_REMOTE | if remote { IS_REMOTE } else { 0 }
}

/// Writes one `Span` message's content.
fn span(w: &mut Writer<'_>, span: &SpanData) {
    let context = &span.span_context;
    w.bytes(1, &context.trace_id().to_bytes());
    w.bytes(2, &context.span_id().to_bytes());
    w.bytes_if_any(3, context.trace_state().header().as_bytes());
    if span.parent_span_id != opentelemetry::trace::SpanId::INVALID {
        w.bytes(4, &span.parent_span_id.to_bytes());
    }
    w.bytes_if_any(5, span.name.as_bytes());
    let kind = match span.span_kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    };
    w.uint(6, kind);
    w.fixed64(7, nanos(span.start_time));
    w.fixed64(8, nanos(span.end_time));
    w.attributes(9, &span.attributes);
    w.uint(10, u64::from(span.dropped_attributes_count));
    for event in span.events.iter() {
        w.message(11, |w| {
            w.fixed64(1, nanos(event.timestamp));
            w.bytes_if_any(2, event.name.as_bytes());
            w.attributes(3, &event.attributes);
            w.uint(4, u64::from(event.dropped_attributes_count));
        });
    }
    w.uint(12, u64::from(span.events.dropped_count));
    for link in span.links.iter() {
        w.message(13, |w| {
            let context = &link.span_context;
            w.bytes(1, &context.trace_id().to_bytes());
            w.bytes(2, &context.span_id().to_bytes());
            w.bytes_if_any(3, context.trace_state().header().as_bytes());
            w.attributes(4, &link.attributes);
            w.uint(5, u64::from(link.dropped_attributes_count));
            w.fixed32(
                6,
                span_flags(context.trace_flags().to_u8(), context.is_remote()),
            );
        });
    }
    w.uint(14, u64::from(span.links.dropped_count));
    w.message(15, |w| match &span.status {
        Status::Unset => {}
        Status::Ok => w.uint(3, 1),
        Status::Error { description } => {
            w.bytes_if_any(2, description.as_bytes());
            w.uint(3, 2);
        }
    });
    w.fixed32(
        16,
        span_flags(context.trace_flags().to_u8(), span.parent_span_is_remote),
    );
}

/// Encodes `spans` as one `ExportTraceServiceRequest` into `out` (cleared first): one
/// `ResourceSpans` for `resource`, one `ScopeSpans` per run of spans from the same
/// instrumentation scope (the router and control plane have one scope each).
pub fn encode_request(resource: Option<&Resource>, spans: &[SpanData], out: &mut Vec<u8>) {
    out.clear();
    let mut w = Writer(out);
    w.message(1, |w| {
        if let Some(resource) = resource {
            w.message(1, |w| {
                for (key, value) in resource.iter() {
                    w.key_value(1, key.as_str(), value);
                }
            });
        }
        let mut rest = spans;
        while let Some(first) = rest.first() {
            let scope = &first.instrumentation_scope;
            let same = rest
                .iter()
                .take_while(|span| span.instrumentation_scope == *scope)
                .count();
            w.message(2, |w| {
                w.message(1, |w| {
                    w.bytes_if_any(1, scope.name().as_bytes());
                    w.bytes_if_any(2, scope.version().unwrap_or_default().as_bytes());
                    for attribute in scope.attributes() {
                        w.key_value(3, attribute.key.as_str(), &attribute.value);
                    }
                });
                for item in &rest[..same] {
                    w.message(2, |w| span(w, item));
                }
                w.bytes_if_any(3, scope.schema_url().unwrap_or_default().as_bytes());
            });
            rest = &rest[same..];
        }
        if let Some(url) = resource.and_then(Resource::schema_url) {
            w.bytes_if_any(3, url.as_bytes());
        }
    });
}

/// A request body already encoded (by [`encode_request`]), for tonic's prost codec.
#[derive(Debug, Clone, Default, PartialEq)]
struct Encoded(bytes::Bytes);

impl prost::Message for Encoded {
    fn encode_raw(&self, buf: &mut impl bytes::BufMut) {
        buf.put_slice(&self.0);
    }

    fn merge_field(
        &mut self,
        _tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl bytes::Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        prost::encoding::skip_field(wire_type, _tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

/// `ExportTraceServiceResponse`: how many spans the collector rejected, and why.
#[derive(Clone, PartialEq, prost::Message)]
struct ExportResponse {
    #[prost(message, optional, tag = "1")]
    partial_success: Option<PartialSuccess>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PartialSuccess {
    #[prost(int64, tag = "1")]
    rejected_spans: i64,
    #[prost(string, tag = "2")]
    error_message: String,
}

/// Sends encoded batches to one collector over gRPC.
pub struct Client {
    grpc: tonic::client::Grpc<tonic::transport::Channel>,
    /// Sent as metadata with every request (`OTEL_EXPORTER_OTLP_HEADERS`).
    metadata: tonic::metadata::MetadataMap,
}

/// Why a batch was not taken.
#[derive(Debug, PartialEq)]
pub struct Failed {
    /// The collector could not be reached or did not answer in time (as opposed to one that
    /// answered and refused the batch).
    pub unreachable: bool,
    pub message: String,
}

impl Failed {
    pub fn unreachable(message: String) -> Self {
        Self {
            unreachable: true,
            message,
        }
    }

    pub fn refused(message: String) -> Self {
        Self {
            unreachable: false,
            message,
        }
    }
}

/// What a collector said to one batch.
#[derive(Debug, PartialEq)]
pub enum Sent {
    /// Every span accepted.
    All,
    /// Some rejected (OTLP's partial success): how many, and the collector's reason.
    Partly { rejected: u64, reason: String },
}

impl Client {
    /// A client that connects on first use (`endpoint`: `http://HOST:PORT`), each call
    /// bounded by `timeout`, `headers` sent with each (valid metadata: see
    /// `telemetry::parse_otlp_headers`; any other is left out). HTTP/2 pings find a collector
    /// that vanished without closing the connection, which is then made anew.
    pub fn new(
        endpoint: &str,
        headers: &[(String, String)],
        timeout: Duration,
    ) -> Result<Self, tonic::transport::Error> {
        let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())?
            .connect_timeout(timeout)
            .timeout(timeout)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10))
            .keep_alive_while_idle(true)
            .connect_lazy();
        let mut metadata = tonic::metadata::MetadataMap::new();
        for (key, value) in headers {
            if let (Ok(key), Ok(value)) = (
                tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
                tonic::metadata::MetadataValue::try_from(value.as_str()),
            ) {
                metadata.append(key, value);
            }
        }
        Ok(Self {
            grpc: tonic::client::Grpc::new(channel),
            metadata,
        })
    }

    /// Sends one encoded request.
    pub async fn export(&mut self, body: bytes::Bytes) -> Result<Sent, Failed> {
        self.grpc
            .ready()
            .await
            .map_err(|err| Failed::unreachable(format!("the collector is not reachable: {err}")))?;
        let codec = tonic_prost::ProstCodec::<Encoded, ExportResponse>::default();
        let path = http::uri::PathAndQuery::from_static(EXPORT_PATH);
        let mut request = tonic::Request::new(Encoded(body));
        *request.metadata_mut() = self.metadata.clone();
        let response = self
            .grpc
            .unary(request, path, codec)
            .await
            .map_err(|status| {
                let message = format!("{}: {}", status.code(), status.message());
                match status.code() {
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded => {
                        Failed::unreachable(message)
                    }
                    _ => Failed::refused(message),
                }
            })?;
        Ok(match response.into_inner().partial_success {
            Some(partial) if partial.rejected_spans > 0 => Sent::Partly {
                rejected: partial.rejected_spans as u64,
                reason: partial.error_message,
            },
            _ => Sent::All,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{Event, Link, SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use opentelemetry::{InstrumentationScope, KeyValue};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::trace::v1::Span as ProtoSpan;
    use prost::Message as _;
    use std::borrow::Cow;

    fn sample(index: u8, scope: &InstrumentationScope) -> SpanData {
        let trace_id = TraceId::from_bytes([index; 16]);
        let mut events = opentelemetry_sdk::trace::SpanEvents::default();
        events.events.push(Event::new(
            "retry",
            UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789),
            vec![KeyValue::new("attempt", 2i64)],
            1,
        ));
        events.dropped_count = 3;
        let mut links = opentelemetry_sdk::trace::SpanLinks::default();
        links.links.push(Link::new(
            SpanContext::new(
                TraceId::from_bytes([9; 16]),
                SpanId::from_bytes([8; 8]),
                TraceFlags::SAMPLED,
                true,
                TraceState::from_key_value([("k", "v")]).unwrap(),
            ),
            vec![KeyValue::new("why", "follows")],
            0,
        ));
        SpanData {
            span_context: SpanContext::new(
                trace_id,
                SpanId::from_bytes([index, 1, 2, 3, 4, 5, 6, 7]),
                TraceFlags::SAMPLED,
                false,
                if index.is_multiple_of(2) {
                    TraceState::default()
                } else {
                    TraceState::from_key_value([("vendor", "1")]).unwrap()
                },
            ),
            parent_span_id: if index.is_multiple_of(2) {
                SpanId::INVALID
            } else {
                SpanId::from_bytes([7; 8])
            },
            parent_span_is_remote: index % 2 == 1,
            span_kind: [SpanKind::Server, SpanKind::Client, SpanKind::Internal]
                [usize::from(index % 3)]
            .clone(),
            name: Cow::Borrowed("POST"),
            start_time: UNIX_EPOCH + Duration::from_nanos(1_700_000_000_000_000_000),
            end_time: UNIX_EPOCH + Duration::from_nanos(1_700_000_000_000_250_000),
            attributes: vec![
                KeyValue::new("http.request.method", "POST"),
                KeyValue::new("http.response.status_code", 200i64),
                KeyValue::new("switchyard.overflow", false),
                KeyValue::new("ratio", 0.25),
                KeyValue::new("negative", -5i64),
                KeyValue::new(
                    "list",
                    Value::Array(opentelemetry::Array::String(vec!["a".into(), "b".into()])),
                ),
                KeyValue::new(
                    "flags",
                    Value::Array(opentelemetry::Array::Bool(vec![true])),
                ),
                KeyValue::new(
                    "numbers",
                    Value::Array(opentelemetry::Array::I64(vec![1, -2])),
                ),
            ],
            dropped_attributes_count: u32::from(index),
            events,
            links,
            status: match index % 3 {
                0 => Status::Unset,
                1 => Status::Ok,
                _ => Status::error("502 Bad Gateway"),
            },
            instrumentation_scope: scope.clone(),
        }
    }

    #[test]
    fn the_bytes_decode_to_what_the_sdk_conversion_makes() {
        let router = InstrumentationScope::builder("switchyard-router").build();
        let other = InstrumentationScope::builder("other")
            .with_version("1.2")
            .with_attributes([KeyValue::new("scope.attr", 1i64)])
            .build();
        let spans: Vec<SpanData> = (0..6)
            .map(|index| sample(index, if index < 4 { &router } else { &other }))
            .collect();
        let resource = Resource::builder_empty()
            .with_service_name("switchyard-router")
            .with_attribute(KeyValue::new("host.name", "h"))
            .build();
        let mut out = Vec::new();
        encode_request(Some(&resource), &spans, &mut out);
        let decoded = ExportTraceServiceRequest::decode(&out[..]).expect("valid protobuf");

        assert_eq!(decoded.resource_spans.len(), 1);
        let resource_spans = &decoded.resource_spans[0];
        use opentelemetry_proto::tonic::common::v1::any_value::Value as ProtoValue;
        let mut service: Vec<(String, String)> = resource_spans
            .resource
            .as_ref()
            .unwrap()
            .attributes
            .iter()
            .map(|kv| {
                let value = match kv.value.as_ref().and_then(|value| value.value.as_ref()) {
                    Some(ProtoValue::StringValue(text)) => text.clone(),
                    other => format!("{other:?}"),
                };
                (kv.key.clone(), value)
            })
            .collect();
        service.sort();
        // The resource's attributes are all text (service and SDK names).
        let mut expected: Vec<(String, String)> = resource
            .iter()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect();
        expected.sort();
        assert_eq!(service, expected);

        // Two scopes, in order, each with its spans exactly as the SDK's conversion has them.
        let scopes = &resource_spans.scope_spans;
        assert_eq!(scopes.len(), 2);
        assert_eq!(scopes[0].scope.as_ref().unwrap().name, "switchyard-router");
        let other_scope = scopes[1].scope.as_ref().unwrap();
        assert_eq!(other_scope.name, "other");
        assert_eq!(other_scope.version, "1.2");
        assert_eq!(other_scope.attributes.len(), 1);
        let got: Vec<&ProtoSpan> = scopes.iter().flat_map(|scope| &scope.spans).collect();
        let want: Vec<ProtoSpan> = spans.into_iter().map(ProtoSpan::from).collect();
        assert_eq!(got.len(), want.len());
        for (got, want) in got.into_iter().zip(&want) {
            assert_eq!(got, want);
        }
    }

    #[test]
    fn an_empty_batch_is_an_empty_resource_spans() {
        let mut out = vec![1, 2, 3];
        encode_request(None, &[], &mut out);
        let decoded = ExportTraceServiceRequest::decode(&out[..]).unwrap();
        assert_eq!(decoded.resource_spans.len(), 1);
        assert!(decoded.resource_spans[0].scope_spans.is_empty());
    }

    #[test]
    fn long_messages_get_multi_byte_lengths() {
        let scope = InstrumentationScope::builder("s").build();
        let mut span = sample(0, &scope);
        span.attributes
            .push(KeyValue::new("big", "x".repeat(300_000)));
        let mut out = Vec::new();
        encode_request(None, &[span.clone()], &mut out);
        let decoded = ExportTraceServiceRequest::decode(&out[..]).unwrap();
        assert_eq!(
            decoded.resource_spans[0].scope_spans[0].spans[0],
            ProtoSpan::from(span)
        );
    }
}
