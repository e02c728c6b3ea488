//! The answer's body as it streams back: passed through frame by frame, holding the instance's
//! in-flight count and the request's admission until it ends, timing its first frame, and
//! ending a stalled answer at the idle deadline. An SSE answer that stalls, fails midway or (a
//! chat or completions stream) ends before its `data: [DONE]` gets a final OpenAI error event
//! and a clean end, so a client reads why; any other body is cut.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::HeaderValue;
use http_body::Frame;
use tokio::time::{Instant, Sleep};

use crate::errors::ErrorKind;
use crate::forward::InFlight;
use crate::observe::labels::UpstreamError;
use crate::observe::metrics::RouterMetrics;
use crate::observe::trace::ShowTraceId;
use crate::server::admission::RequestPermit;

/// What a stalled or broken answer ends with.
#[derive(Debug, Clone, Copy)]
pub(super) enum Stall {
    /// A streamed (SSE) answer gets a final error event, then ends without `[DONE]`.
    SseErrorEvent,
    /// Any other body is cut (the client sees an incomplete answer).
    Cut,
}

const STREAM_IDLE_EVENT: &str = "data: {\"error\":{\"message\":\"the instance sent nothing for longer than --stream-idle-timeout-seconds; the answer is incomplete\",\"type\":\"timeout\",\"param\":null,\"code\":\"stream_idle_timeout\"}}\n\n";

pub(super) const STREAM_BROKEN_EVENT: &str = "data: {\"error\":{\"message\":\"the instance's answer broke off midway (its connection failed or it ended before its final event); the answer is incomplete\",\"type\":\"server_error\",\"param\":null,\"code\":\"upstream_reset\"}}\n\n";

/// Whether an OpenAI stream's last event so far is `data: [DONE]`: the last bytes seen, enough
/// to hold that line and the blank line after it.
#[derive(Debug, Default)]
pub(super) struct DoneWatch {
    tail: Vec<u8>,
}

impl DoneWatch {
    const KEEP: usize = 32;
    const DONE: &[u8] = b"data: [DONE]";

    fn saw(&mut self, data: &[u8]) {
        let data = &data[data.len().saturating_sub(Self::KEEP)..];
        let keep = Self::KEEP - data.len();
        let drop = self.tail.len().saturating_sub(keep);
        self.tail.drain(..drop);
        self.tail.extend_from_slice(data);
    }

    fn done(&self) -> bool {
        self.tail.trim_ascii_end().ends_with(Self::DONE)
    }
}

pub(super) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The upstream response body, passed through frame by frame. It holds the instance's
/// in-flight count and the request's admission until the body ends, fails, stalls for the
/// idle deadline, or is dropped (the client went away; dropping the upstream body closes
/// the engine's connection, which cancels its work).
pub(super) struct TrackedBody {
    /// `None` once the body ended, failed or stalled.
    pub(super) inner: Option<crate::forward::refusal::UpstreamBody>,
    pub(super) in_flight: Option<InFlight>,
    /// The request's admission; `None` when the body that wraps this one holds it.
    pub(super) permit: Option<RequestPermit>,
    pub(super) idle: Duration,
    pub(super) last_frame: Instant,
    /// Armed on the first wait; reset only when it fires early (frames arrived meanwhile).
    pub(super) timer: Option<Pin<Box<Sleep>>>,
    pub(super) stall: Stall,
    pub(super) metrics: Arc<RouterMetrics>,
    /// When set, the time to the first data frame is observed (a disaggregated decode's TTFT).
    pub(super) first_frame: Option<FirstFrame>,
    pub(super) ids: LogIds,
    /// A chat or completions stream, which ends with `data: [DONE]`: an end before it counts
    /// as a break.
    pub(super) done: Option<DoneWatch>,
    /// An SSE answer's bytes after its last whole event, held until the event is whole, so
    /// that a final error event never lands inside half an event.
    pub(super) partial: BytesMut,
}

/// The longest SSE event held back whole; a longer one passes through as it comes.
const MAX_HELD_EVENT: usize = 1 << 20;

/// Of an SSE answer's `data`, what ends on an event boundary (the rest is held in `partial`).
fn whole_events(partial: &mut BytesMut, data: Bytes) -> Bytes {
    let boundary = |bytes: &[u8]| bytes.ends_with(b"\n\n") || bytes.ends_with(b"\r\n\r\n");
    if partial.is_empty() && boundary(&data) {
        return data;
    }
    partial.extend_from_slice(&data);
    let end = (0..partial.len())
        .rev()
        .find(|&at| boundary(&partial[..at + 1]))
        .map_or(0, |at| at + 1);
    if end == 0 && partial.len() > MAX_HELD_EVENT {
        return partial.split().freeze();
    }
    partial.split_to(end).freeze()
}

/// A request's ids for the log lines of its answer.
pub(super) struct LogIds {
    pub(super) request_id: Option<HeaderValue>,
    pub(super) trace_id: Option<opentelemetry::trace::TraceId>,
}

impl LogIds {
    fn request_id(&self) -> &str {
        self.request_id
            .as_ref()
            .and_then(|value| value.to_str().ok())
            .unwrap_or("")
    }
}

/// Timing the answer's first data frame (TTFT).
pub(super) struct FirstFrame {
    /// The request sent upstream.
    pub(super) sent: Instant,
    /// Its response head received.
    pub(super) answered: Instant,
    /// Also a disaggregated decode's TTFT (from the head).
    pub(super) disaggregated_decode: bool,
}

impl TrackedBody {
    /// One answer of a migrating stream (`super::migrate`): a break fails the body (the
    /// wrapper decides what the client sees), an end before `[DONE]` is a break, and the
    /// wrapper holds the request's admission.
    pub(super) fn leg(
        incoming: crate::forward::refusal::UpstreamBody,
        in_flight: InFlight,
        idle: Duration,
        metrics: Arc<RouterMetrics>,
    ) -> Self {
        Self {
            inner: Some(incoming),
            in_flight: Some(in_flight),
            permit: None,
            idle,
            last_frame: Instant::now(),
            timer: None,
            stall: Stall::Cut,
            metrics,
            first_frame: None,
            ids: LogIds {
                request_id: None,
                trace_id: None,
            },
            done: Some(DoneWatch::default()),
            partial: BytesMut::new(),
        }
    }
}

/// Whether an answer's head says it is an SSE stream.
pub(super) fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.trim_start().starts_with("text/event-stream"))
}

/// Why a chat or completions stream that ended cleanly still broke.
const ENDED_BEFORE_DONE: &str = "the answer ended before its data: [DONE]";

impl TrackedBody {
    /// The last frame of a stream that ends before `[DONE]`: that frame, then the error
    /// event, in one.
    fn complete_broken(
        &mut self,
        frame: Frame<Bytes>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let Poll::Ready(Some(Ok(event))) = self.broken(ENDED_BEFORE_DONE.into()) else {
            // Not an SSE answer: the last frame as it is; nothing is known to be missing.
            return Poll::Ready(Some(Ok(frame)));
        };
        let mut data = frame.into_data().map(Vec::from).unwrap_or_default();
        data.extend_from_slice(event.data_ref().map(|bytes| &bytes[..]).unwrap_or_default());
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(data)))))
    }

    fn end(&mut self) {
        self.inner = None;
        self.in_flight = None;
        self.permit = None;
        self.timer = None;
    }

    /// The answer broke (a failed connection, or an end before `[DONE]`): an SSE answer ends
    /// with an error event, any other fails with `err`.
    fn broken(&mut self, err: BoxError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.count_upstream(UpstreamError::Reset);
        self.end();
        self.metrics.error(ErrorKind::UpstreamReset);
        tracing::warn!(request_id = self.ids.request_id(), trace_id = %ShowTraceId(self.ids.trace_id), error = %err, "the instance's answer failed midway");
        match self.stall {
            Stall::SseErrorEvent => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(
                STREAM_BROKEN_EVENT.as_bytes(),
            ))))),
            Stall::Cut => Poll::Ready(Some(Err(err))),
        }
    }

    fn count_upstream(&self, kind: UpstreamError) {
        if let Some(in_flight) = &self.in_flight {
            in_flight.cell().count_upstream(kind);
        }
    }

    /// True once the idle deadline passed with no frame.
    fn stalled(&mut self, cx: &mut Context<'_>) -> bool {
        let (idle, last_frame) = (self.idle, self.last_frame);
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(last_frame + idle)));
        loop {
            if timer.as_mut().poll(cx).is_pending() {
                return false;
            }
            let due = self.last_frame + idle;
            if Instant::now() >= due {
                return true;
            }
            timer.as_mut().reset(due);
        }
    }
}

impl TrackedBody {
    /// One frame of the answer, as [`http_body::Body::poll_frame`] gives it (which skips the
    /// empty frames of an SSE event held until whole).
    fn poll_one(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match http_body::Body::poll_frame(Pin::new(&mut *inner), cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(done), Some(data)) = (this.done.as_mut(), frame.data_ref()) {
                    done.saw(data);
                }
                let frame = match (this.stall, frame.into_data()) {
                    (Stall::SseErrorEvent, Ok(data)) => {
                        Frame::data(whole_events(&mut this.partial, data))
                    }
                    (_, Ok(data)) => Frame::data(data),
                    (_, Err(frame)) => frame,
                };
                if frame.data_ref().is_some_and(|data| !data.is_empty())
                    && let Some(first) = this.first_frame.take()
                {
                    this.metrics
                        .upstream_ttft_seconds
                        .observe(first.sent.elapsed().as_secs_f64());
                    if first.disaggregated_decode {
                        this.metrics
                            .disaggregation_decode_ttft_seconds
                            .observe(first.answered.elapsed().as_secs_f64());
                    }
                }
                if http_body::Body::is_end_stream(inner) {
                    // hyper drops a body as soon as it is complete, without a last poll: a
                    // stream that ends before `[DONE]` gets its error event with this frame.
                    if this.done.as_ref().is_some_and(|done| !done.done()) {
                        return this.complete_broken(frame);
                    }
                    // A whole answer: what was held goes too.
                    let frame = match frame.into_data() {
                        Ok(data) if !this.partial.is_empty() => {
                            this.partial.extend_from_slice(&data);
                            Frame::data(this.partial.split().freeze())
                        }
                        Ok(data) => Frame::data(data),
                        Err(frame) => frame,
                    };
                    this.end();
                    return Poll::Ready(Some(Ok(frame)));
                } else {
                    this.last_frame = Instant::now();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => this.broken(err.into()),
            Poll::Ready(None) => {
                if this.done.as_ref().is_some_and(|done| !done.done()) {
                    return this.broken(ENDED_BEFORE_DONE.into());
                }
                let rest = this.partial.split().freeze();
                this.end();
                if rest.is_empty() {
                    Poll::Ready(None)
                } else {
                    Poll::Ready(Some(Ok(Frame::data(rest))))
                }
            }
            Poll::Pending => {
                if !this.stalled(cx) {
                    return Poll::Pending;
                }
                this.count_upstream(UpstreamError::StreamIdle);
                this.end();
                this.metrics.error(ErrorKind::StreamIdleTimeout);
                tracing::warn!(request_id = this.ids.request_id(), trace_id = %ShowTraceId(this.ids.trace_id), idle = ?this.idle, "the instance's answer stalled; closing it");
                match this.stall {
                    Stall::SseErrorEvent => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(
                        STREAM_IDLE_EVENT.as_bytes(),
                    ))))),
                    // A timed-out I/O error: SageMaker's stream says
                    // ModelInvocationTimeExceeded for it.
                    Stall::Cut => Poll::Ready(Some(Err(Box::new(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the instance's answer stalled (--stream-idle-timeout-seconds)",
                    ))))),
                }
            }
        }
    }
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        loop {
            let polled = this.poll_one(cx);
            let held = matches!(&polled, Poll::Ready(Some(Ok(frame)))
                if frame.data_ref().is_some_and(Bytes::is_empty) && this.inner.is_some());
            if !held {
                return polled;
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner
            .as_ref()
            .is_none_or(|inner| inner.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match &self.inner {
            Some(inner) => inner.size_hint(),
            None => http_body::SizeHint::default(),
        }
    }
}

impl Drop for TrackedBody {
    fn drop(&mut self) {
        if self
            .inner
            .as_ref()
            .is_some_and(|inner| !http_body::Body::is_end_stream(inner))
        {
            self.metrics.error(ErrorKind::ClientGone);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_final_events_are_one_openai_error_event_each() {
        for (event, code) in [
            (STREAM_IDLE_EVENT, "stream_idle_timeout"),
            (STREAM_BROKEN_EVENT, "upstream_reset"),
        ] {
            let data = event
                .strip_prefix("data: ")
                .and_then(|rest| rest.strip_suffix("\n\n"))
                .unwrap();
            let json: serde_json::Value = serde_json::from_str(data).unwrap();
            assert_eq!(json["error"]["code"], code);
        }
    }

    #[test]
    fn only_whole_events_pass_and_the_rest_waits_for_its_end() {
        let mut partial = BytesMut::new();
        let whole = Bytes::from_static(b"data: {\"a\":1}\n\n");
        assert_eq!(whole_events(&mut partial, whole.clone()), whole);
        assert_eq!(
            whole_events(
                &mut partial,
                Bytes::from_static(b"data: {\"a\":2}\n\ndata: {\"b")
            ),
            Bytes::from_static(b"data: {\"a\":2}\n\n")
        );
        assert!(whole_events(&mut partial, Bytes::from_static(b"\":3}")).is_empty());
        assert_eq!(
            whole_events(&mut partial, Bytes::from_static(b"\r\n\r\n")),
            Bytes::from_static(b"data: {\"b\":3}\r\n\r\n")
        );
        assert!(partial.is_empty());
    }

    #[test]
    fn done_is_the_last_event_seen_across_frames() {
        let mut watch = DoneWatch::default();
        assert!(!watch.done());
        watch.saw(b"data: {\"choices\":[{\"delta\":{\"content\":\"[DONE]\"}}]}\n\n");
        assert!(
            !watch.done(),
            "[DONE] inside an event's text is not the end"
        );
        watch.saw(b"data: [DO");
        watch.saw(b"NE]\n\n");
        assert!(watch.done());
        watch.saw(&[b'x'; 100]);
        assert!(!watch.done());
        watch.saw(b"data: [DONE]\n\n");
        assert!(watch.done());
    }
}
