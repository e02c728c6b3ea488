//! SageMaker's streaming-invoke answer (`/endpoints/{e}/invocations-response-stream`): the
//! engine's body re-framed, frame by frame as it arrives, in the AWS event-stream binary
//! format (`application/vnd.amazon.eventstream`) that boto3's
//! `invoke_endpoint_with_response_stream` and the AWS SDKs decode.
//!
//! A message is a prelude (total length, headers length, both u32 big-endian, then the CRC-32
//! of those 8 bytes), headers, the payload, and the CRC-32 of everything before it. A header
//! is a 1-byte name length, the name, a type byte (7: string), a u16 big-endian value length
//! and the value. The shapes come from the `sagemaker-runtime` service model (botocore
//! `InvokeEndpointWithResponseStream`, union `ResponseStream`):
//!
//! - every upstream data frame becomes one `PayloadPart` event whose payload is the frame's
//!   bytes as they are (`PayloadPart.Bytes` is the event payload, a blob);
//! - an upstream body that fails mid-stream (the engine died or the connection broke) becomes
//!   one `ModelStreamError` exception event, `{"Message", "ErrorCode"}` with SageMaker's codes
//!   `StreamBroken` or `ModelInvocationTimeExceeded`, and the stream ends;
//! - the stream ends when the upstream body ends (no closing event).
//!
//! CRC-32 is the IEEE polynomial, from `crc32fast`.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderValue};
use http_body::{Body, Frame, SizeHint};

/// The content type of an event stream.
pub const CONTENT_TYPE: &str = "application/vnd.amazon.eventstream";

/// Prelude (8 bytes), its CRC (4), and the message CRC (4).
const OVERHEAD: usize = 16;
const HEADER_TYPE_STRING: u8 = 7;

const PAYLOAD_PART_HEADERS: &[(&str, &str)] = &[
    (":event-type", "PayloadPart"),
    (":content-type", "application/octet-stream"),
    (":message-type", "event"),
];

/// One event-stream message with string headers.
pub fn encode_message(headers: &[(&str, &str)], payload: &[u8]) -> Bytes {
    let headers_len: usize = headers
        .iter()
        .map(|(name, value)| 1 + name.len() + 1 + 2 + value.len())
        .sum();
    let total = OVERHEAD + headers_len + payload.len();
    let mut buffer = BytesMut::with_capacity(total);
    // Lengths fit: payloads are at most one upstream frame and headers are ours.
    buffer.put_u32(total as u32);
    buffer.put_u32(headers_len as u32);
    let prelude_crc = crc32fast::hash(&buffer[..8]);
    buffer.put_u32(prelude_crc);
    for (name, value) in headers {
        debug_assert!(name.len() <= u8::MAX as usize && value.len() <= u16::MAX as usize);
        buffer.put_u8(name.len() as u8);
        buffer.put_slice(name.as_bytes());
        buffer.put_u8(HEADER_TYPE_STRING);
        buffer.put_u16(value.len() as u16);
        buffer.put_slice(value.as_bytes());
    }
    buffer.put_slice(payload);
    let message_crc = crc32fast::hash(&buffer);
    buffer.put_u32(message_crc);
    buffer.freeze()
}

/// A `PayloadPart` event carrying `bytes`.
pub fn payload_part(bytes: &[u8]) -> Bytes {
    encode_message(PAYLOAD_PART_HEADERS, bytes)
}

/// SageMaker's `ModelStreamError` codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamErrorCode {
    /// The connection to the model was reset or closed.
    StreamBroken,
    /// The model did not finish in time.
    ModelInvocationTimeExceeded,
}

impl StreamErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamErrorCode::StreamBroken => "StreamBroken",
            StreamErrorCode::ModelInvocationTimeExceeded => "ModelInvocationTimeExceeded",
        }
    }

    /// The code for an upstream body error: a timeout anywhere in its chain is
    /// `ModelInvocationTimeExceeded`, anything else `StreamBroken`.
    pub fn of(error: &(dyn std::error::Error + 'static)) -> Self {
        let mut cause = Some(error);
        while let Some(current) = cause {
            let timed_out = current
                .downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
                || current
                    .downcast_ref::<hyper::Error>()
                    .is_some_and(hyper::Error::is_timeout)
                || current.is::<tokio::time::error::Elapsed>();
            if timed_out {
                return StreamErrorCode::ModelInvocationTimeExceeded;
            }
            cause = current.source();
        }
        StreamErrorCode::StreamBroken
    }
}

/// An error and its sources, `outer: inner: innermost`.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(current) = cause {
        let inner = current.to_string();
        if !text.ends_with(&inner) {
            text.push_str(": ");
            text.push_str(&inner);
        }
        cause = current.source();
    }
    text
}

/// A `ModelStreamError` exception event.
pub fn model_stream_error(code: StreamErrorCode, message: &str) -> Bytes {
    let payload = serde_json::json!({"Message": message, "ErrorCode": code.as_str()});
    encode_message(
        &[
            (":exception-type", "ModelStreamError"),
            (":content-type", "application/json"),
            (":message-type", "exception"),
        ],
        payload.to_string().as_bytes(),
    )
}

/// Sets the response headers of a streaming invoke: the event-stream content type, the
/// model's own content type in `X-Amzn-SageMaker-Content-Type`, and no length (the framing
/// changes it).
pub fn set_headers(headers: &mut HeaderMap) {
    if let Some(model_type) = headers.remove(header::CONTENT_TYPE) {
        headers.insert(crate::headers::MODEL_CONTENT_TYPE, model_type);
    }
    headers.remove(header::CONTENT_LENGTH);
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
}

/// The upstream body re-framed as `PayloadPart` events, one per data frame as it arrives; an
/// upstream error becomes a `ModelStreamError` event that ends the stream. It never fails
/// itself: the client always gets a well-formed event stream.
pub struct PayloadParts<B> {
    inner: B,
    done: bool,
}

impl<B> PayloadParts<B> {
    pub fn new(inner: B) -> Self {
        Self { inner, done: false }
    }
}

/// What upstream bodies fail with.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<B> Body for PayloadParts<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        loop {
            if self.done {
                return Poll::Ready(None);
            }
            let polled = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
            match polled {
                None => {
                    self.done = true;
                    return Poll::Ready(None);
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => {
                        return Poll::Ready(Some(Ok(Frame::data(payload_part(&data)))));
                    }
                    // Empty data and trailers carry nothing a PayloadPart could hold.
                    _ => continue,
                },
                Some(Err(err)) => {
                    self.done = true;
                    let err: BoxError = err.into();
                    let code = StreamErrorCode::of(err.as_ref());
                    let cause = error_chain(err.as_ref());
                    tracing::info!(error = %cause, code = code.as_str(), "model stream broke mid-response");
                    let message = format!("the model's response stream ended early: {cause}");
                    return Poll::Ready(Some(Ok(Frame::data(model_stream_error(code, &message)))));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// A decoded message: its headers and its payload.
    type Decoded = (Vec<(String, String)>, Vec<u8>);

    /// Decodes messages, checking both CRCs and every length.
    fn decode(mut bytes: &[u8]) -> Vec<Decoded> {
        let mut messages = Vec::new();
        while !bytes.is_empty() {
            let total = u32::from_be_bytes(bytes[0..4].try_into().unwrap()) as usize;
            let headers_len = u32::from_be_bytes(bytes[4..8].try_into().unwrap()) as usize;
            let prelude_crc = u32::from_be_bytes(bytes[8..12].try_into().unwrap());
            assert_eq!(prelude_crc, crc32fast::hash(&bytes[..8]), "prelude crc");
            let message_crc = u32::from_be_bytes(bytes[total - 4..total].try_into().unwrap());
            assert_eq!(
                message_crc,
                crc32fast::hash(&bytes[..total - 4]),
                "message crc"
            );
            let mut headers = Vec::new();
            let mut rest = &bytes[12..12 + headers_len];
            while !rest.is_empty() {
                let name_len = rest[0] as usize;
                let name = String::from_utf8(rest[1..1 + name_len].to_vec()).unwrap();
                assert_eq!(rest[1 + name_len], HEADER_TYPE_STRING);
                let at = 2 + name_len;
                let value_len = u16::from_be_bytes([rest[at], rest[at + 1]]) as usize;
                let value = String::from_utf8(rest[at + 2..at + 2 + value_len].to_vec()).unwrap();
                headers.push((name, value));
                rest = &rest[at + 2 + value_len..];
            }
            messages.push((headers, bytes[12 + headers_len..total - 4].to_vec()));
            bytes = &bytes[total..];
        }
        messages
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|byte| format!("{byte:02x}")).collect()
    }

    /// Golden vectors, checked with botocore 1.44's own decoder: `botocore.eventstream.EventStream`
    /// over the `sagemaker-runtime` model's `ResponseStream` shape yields
    /// `{'PayloadPart': {'Bytes': b'data: {"x":1}\n\n'}}` for the first, and raises
    /// `EventStreamError` with code `ModelStreamError`, message "engine went away", for the
    /// second. `tests/tests/sagemaker.rs` decodes live streams with boto3 as well.
    #[test]
    fn payload_part_and_model_stream_error_match_the_golden_vectors() {
        assert_eq!(
            hex(&payload_part(b"data: {\"x\":1}\n\n")),
            PAYLOAD_PART_VECTOR,
        );
        assert_eq!(
            hex(&model_stream_error(
                StreamErrorCode::StreamBroken,
                "engine went away"
            )),
            MODEL_STREAM_ERROR_VECTOR,
        );
    }

    const PAYLOAD_PART_VECTOR: &str = "0000007800000059be379d370b3a6576656e742d7479706507000b5061796c6f6164506172740d3a636f6e74656e742d747970650700186170706c69636174696f6e2f6f637465742d73747265616d0d3a6d6573736167652d747970650700056576656e74646174613a207b2278223a317d0a0a3da38c34";
    const MODEL_STREAM_ERROR_VECTOR: &str = "000000a70000005e2bf6e01c0f3a657863657074696f6e2d747970650700104d6f64656c53747265616d4572726f720d3a636f6e74656e742d747970650700106170706c69636174696f6e2f6a736f6e0d3a6d6573736167652d74797065070009657863657074696f6e7b224572726f72436f6465223a2253747265616d42726f6b656e222c224d657373616765223a22656e67696e652077656e742061776179227de8b6ed9e";

    #[test]
    fn messages_decode_with_their_headers_and_payload() {
        let part = decode(&payload_part(b"hello"));
        assert_eq!(part.len(), 1);
        assert_eq!(
            part[0].0,
            [
                (":event-type".to_owned(), "PayloadPart".to_owned()),
                (
                    ":content-type".to_owned(),
                    "application/octet-stream".to_owned()
                ),
                (":message-type".to_owned(), "event".to_owned()),
            ]
        );
        assert_eq!(part[0].1, b"hello");

        let error = decode(&model_stream_error(
            StreamErrorCode::ModelInvocationTimeExceeded,
            "slow",
        ));
        assert_eq!(
            error[0].0[0],
            (":exception-type".into(), "ModelStreamError".into())
        );
        assert_eq!(error[0].0[2], (":message-type".into(), "exception".into()));
        let payload: serde_json::Value = serde_json::from_slice(&error[0].1).unwrap();
        assert_eq!(
            payload,
            serde_json::json!({"Message": "slow", "ErrorCode": "ModelInvocationTimeExceeded"})
        );
    }

    /// A body made of scripted frames, then an optional error.
    struct Scripted {
        frames: std::collections::VecDeque<Result<Frame<Bytes>, std::io::Error>>,
    }

    impl Body for Scripted {
        type Data = Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(self.frames.pop_front())
        }
    }

    async fn reframe(frames: Vec<Result<Frame<Bytes>, std::io::Error>>) -> Vec<Decoded> {
        let body = PayloadParts::new(Scripted {
            frames: frames.into(),
        });
        let bytes = body.collect().await.unwrap().to_bytes();
        decode(&bytes)
    }

    #[tokio::test]
    async fn each_data_frame_becomes_one_payload_part_and_empty_frames_none() {
        let messages = reframe(vec![
            Ok(Frame::data(Bytes::from_static(b"data: a\n\n"))),
            Ok(Frame::data(Bytes::new())),
            Ok(Frame::trailers(HeaderMap::new())),
            Ok(Frame::data(Bytes::from_static(b"data: b\n\n"))),
        ])
        .await;
        let payloads: Vec<&[u8]> = messages.iter().map(|(_, payload)| &payload[..]).collect();
        assert_eq!(payloads, [&b"data: a\n\n"[..], &b"data: b\n\n"[..]]);
    }

    #[tokio::test]
    async fn an_upstream_error_becomes_the_last_event() {
        let messages = reframe(vec![
            Ok(Frame::data(Bytes::from_static(b"part"))),
            Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "reset",
            )),
            Ok(Frame::data(Bytes::from_static(b"never sent"))),
        ])
        .await;
        assert_eq!(messages.len(), 2);
        assert_eq!(messages[0].1, b"part");
        assert_eq!(messages[1].0[0].1, "ModelStreamError");
        let payload: serde_json::Value = serde_json::from_slice(&messages[1].1).unwrap();
        assert_eq!(payload["ErrorCode"], "StreamBroken");

        let messages = reframe(vec![Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "idle",
        ))])
        .await;
        let payload: serde_json::Value = serde_json::from_slice(&messages[0].1).unwrap();
        assert_eq!(payload["ErrorCode"], "ModelInvocationTimeExceeded");
    }

    #[test]
    fn headers_say_event_stream_and_keep_the_model_type() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("12"));
        set_headers(&mut headers);
        assert_eq!(headers[header::CONTENT_TYPE], CONTENT_TYPE);
        assert_eq!(
            headers[crate::headers::MODEL_CONTENT_TYPE],
            "text/event-stream"
        );
        assert!(!headers.contains_key(header::CONTENT_LENGTH));
    }
}
