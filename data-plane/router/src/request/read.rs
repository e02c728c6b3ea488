//! Reading a request body: within SageMaker's size limit, within `--client-body-timeout-seconds`,
//! and counted against `--max-buffered-bytes` as it arrives. A refused body is read away
//! (bounded) so the client sees the answer rather than a reset.

use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http_body_util::BodyExt;

use crate::errors::ApiError;
use crate::headers;
use crate::server::admission::BufferReservation;

/// SageMaker's payload limit.
pub const MAX_BODY_BYTES: usize = 6_291_456;

/// Bodies above this size are parsed and routed on a blocking thread: parsing 256 KiB of
/// JSON takes about a millisecond, too long to hold a serving thread.
pub const OFFLOAD_BYTES: usize = 256 * 1024;

/// Reads the whole body into memory of its own (never a slice pinning a connection's read
/// buffer), counting the memory it takes against `reservation`: a declared `Content-Length`
/// (at most [`MAX_BODY_BYTES`]) is reserved before reading, a chunked body as bytes arrive
/// (it cannot reserve more than twice what it has actually sent).
pub async fn read_body(
    body: Body,
    headers: &HeaderMap,
    deadline: Duration,
    reservation: &mut BufferReservation,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > MAX_BODY_BYTES as u64) {
        refuse_unread(body, headers).await;
        return Err(ApiError::too_large(MAX_BODY_BYTES));
    }
    let declared = declared.map(|length| length as usize);
    // A declared length is reserved whole before anything is read: reservations that grow
    // as bytes arrive let every body of a flood take a share of the budget, and then each
    // one's next doubling is refused, so that nearly all are refused after being half read.
    // Refused here, a client waiting on `Expect: 100-continue` is not invited to upload.
    if let Some(length) = declared
        && !reservation.grow_to(length as u64)
    {
        refuse_unread(body, headers).await;
        return Err(over_budget());
    }
    match tokio::time::timeout(deadline, collect(body, declared, reservation)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err((refusal, rest))) => {
            if let Some(rest) = rest {
                discard(rest).await;
            }
            Err(refusal)
        }
        Err(_) => Err(ApiError::client_timeout(format!(
            "the request body did not arrive within {} s (--client-body-timeout-seconds)",
            deadline.as_secs()
        ))),
    }
}
fn over_budget() -> ApiError {
    ApiError::overloaded(
        "the router holds as many request bodies as it may (--max-buffered-bytes); retry shortly",
    )
}

/// Before refusing a request whose body is unread: reads the body away, unless the client
/// asked `Expect: 100-continue` (it has sent nothing yet and will send nothing once it sees
/// the refusal: reading would make hyper invite the upload).
pub async fn refuse_unread(body: Body, headers: &HeaderMap) {
    let waits_for_continue = headers
        .get(header::EXPECT)
        .is_some_and(|value| value.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if !waits_for_continue {
        discard(body).await;
    }
}

/// Collects the frames into one allocation, grown by doubling (up to the declared length)
/// and counted by its capacity. On a refusal the rest of the body comes back to be read away.
async fn collect(
    mut body: Body,
    declared: Option<usize>,
    reservation: &mut BufferReservation,
) -> Result<Bytes, (ApiError, Option<Body>)> {
    let mut buffer: Vec<u8> = Vec::new();
    // The declared length is already reserved ([`read_body`]).
    if let Some(declared) = declared {
        buffer.reserve_exact(declared);
    }
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|err| {
            (
                ApiError::validation(format!("cannot read the request body: {err}")),
                None,
            )
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let needed = buffer.len() + data.len();
        if needed > MAX_BODY_BYTES {
            return Err((ApiError::too_large(MAX_BODY_BYTES), Some(body)));
        }
        if needed > buffer.capacity() {
            let mut capacity = needed.max(buffer.capacity() * 2).min(MAX_BODY_BYTES);
            if let Some(declared) = declared
                && declared >= needed
            {
                capacity = capacity.min(declared);
            }
            if !reservation.grow_to(capacity as u64) {
                return Err((over_budget(), Some(body)));
            }
            buffer.reserve_exact(capacity - buffer.len());
        }
        buffer.extend_from_slice(&data);
    }
    if buffer.capacity() > buffer.len() {
        buffer.shrink_to_fit();
    }
    reservation.resize_to(buffer.capacity() as u64);
    Ok(Bytes::from(buffer))
}

/// Reads and drops the rest of a request body that is refused, so that the client can finish
/// sending and read the answer: closing a connection with unread data makes the kernel reset
/// it, and the client would see a reset instead of the refusal. Bounded: at most 64 MiB or
/// 5 seconds, then the connection is closed anyway.
pub async fn discard(mut body: Body) {
    const MOST_BYTES: usize = 64 << 20;
    const MOST_TIME: Duration = Duration::from_secs(5);
    let _ = tokio::time::timeout(MOST_TIME, async {
        let mut seen = 0usize;
        while let Some(Ok(frame)) = body.frame().await {
            seen += frame.data_ref().map_or(0, Bytes::len);
            if seen > MOST_BYTES {
                break;
            }
        }
    })
    .await;
}

/// Gives the request an `x-request-id` when the client sent none (both hops and every log
/// line carry it).
pub(crate) fn ensure_request_id(request_headers: &mut HeaderMap) {
    if !request_headers.contains_key(&headers::REQUEST_ID) {
        let id = format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..));
        if let Ok(value) = HeaderValue::from_str(&id) {
            request_headers.insert(headers::REQUEST_ID, value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::errors::ErrorKind;
    use crate::server::admission::Admission;
    use crate::server::admission::Limits;
    use std::sync::Arc;

    fn admission(bytes: u64) -> Arc<Admission> {
        Arc::new(Admission::new(Limits {
            max_connections: 1,
            max_in_flight: 1,
            max_buffered_bytes: bytes,
        }))
    }

    fn chunked(parts: &[&'static [u8]]) -> Body {
        let frames: Vec<Result<Bytes, std::io::Error>> = parts
            .iter()
            .map(|part| Ok(Bytes::from_static(part)))
            .collect();
        Body::from_stream(futures::stream::iter(frames))
    }

    /// Reads a body of `parts` sent with `headers` within a second.
    async fn read_chunks(
        parts: &[&'static [u8]],
        headers: &HeaderMap,
        reservation: &mut BufferReservation,
    ) -> Result<Bytes, ApiError> {
        read_body(chunked(parts), headers, Duration::from_secs(1), reservation).await
    }

    #[tokio::test]
    async fn a_body_is_counted_while_held_and_released_after() {
        let admission = admission(10);
        let mut reservation = admission.buffer();
        let body = read_chunks(&[b"abc", b"def"], &HeaderMap::new(), &mut reservation)
            .await
            .unwrap();
        assert_eq!(&body[..], b"abcdef");
        assert_eq!(admission.buffered_bytes(), 6);
        drop(reservation);
        assert_eq!(admission.buffered_bytes(), 0);
    }

    #[tokio::test]
    async fn a_body_over_the_budget_is_refused_with_retry_after() {
        let admission = admission(4);
        let mut reservation = admission.buffer();
        let err = read_chunks(&[b"abc", b"def"], &HeaderMap::new(), &mut reservation)
            .await
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::Overloaded);
        assert!(err.retry_after.is_some());
        // A declared length over the budget is refused before reading.
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, "5".parse().unwrap());
        let mut reservation = admission.buffer();
        let err = read_chunks(&[b"abcde"], &headers, &mut reservation)
            .await
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::Overloaded);
        assert_eq!(reservation.bytes(), 0);
    }

    #[tokio::test]
    async fn a_declared_length_is_reserved_whole_before_reading_so_a_flood_admits_whole_bodies() {
        // Budget for one 6 MB body and a half: the first declared body takes 6 MB before any
        // byte arrives; the second is refused at once, not after half of it was read.
        let admission = admission(9 << 20);
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, "6000000".parse().unwrap());
        let mut first = admission.buffer();
        let (sender, receiver) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(receiver));
        let reading = read_body(body, &headers, Duration::from_secs(5), &mut first);
        tokio::pin!(reading);
        assert!(futures::poll!(reading.as_mut()).is_pending());
        assert_eq!(admission.buffered_bytes(), 6_000_000, "declared, reserved");
        let mut second = admission.buffer();
        let err = read_chunks(&[b"abc"], &headers, &mut second)
            .await
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::Overloaded);
        assert_eq!(second.bytes(), 0);
        assert_eq!(admission.buffered_bytes(), 6_000_000);
        drop(sender);
    }

    #[tokio::test]
    async fn a_refused_declared_body_is_not_read_when_the_client_waits_for_100_continue() {
        // Reading the body would make hyper send `100 Continue` and invite a 6 MB upload that
        // is then thrown away; refused before reading, the client sends nothing.
        let admission = admission(1 << 20);
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, "6000000".parse().unwrap());
        headers.insert(header::EXPECT, "100-continue".parse().unwrap());
        let polled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = Arc::clone(&polled);
        let body = Body::from_stream(futures::stream::poll_fn(move |_| {
            seen.store(true, std::sync::atomic::Ordering::SeqCst);
            std::task::Poll::Ready(None::<Result<Bytes, std::io::Error>>)
        }));
        let mut reservation = admission.buffer();
        let err = read_body(body, &headers, Duration::from_secs(1), &mut reservation)
            .await
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::Overloaded);
        assert!(
            !polled.load(std::sync::atomic::Ordering::SeqCst),
            "the body was read"
        );
        assert_eq!(admission.buffered_bytes(), 0);
    }

    #[tokio::test]
    async fn a_slow_body_times_out_with_408() {
        let admission = admission(100);
        let mut reservation = admission.buffer();
        let never = Body::from_stream(futures::stream::pending::<Result<Bytes, std::io::Error>>());
        let err = read_body(
            never,
            &HeaderMap::new(),
            Duration::from_millis(20),
            &mut reservation,
        )
        .await
        .unwrap_err();
        assert_eq!(err.kind, ErrorKind::ClientTimeout);
        assert_eq!(err.status, http::StatusCode::REQUEST_TIMEOUT);
    }
}
