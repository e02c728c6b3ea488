//! One client connection: served by hyper (HTTP/1.1 or HTTP/2), watched so that no client
//! holds it past a deadline.
//!
//! hyper bounds the time to send an HTTP/1 request head (and an idle keep-alive connection)
//! by `--client-header-timeout-seconds`; the watchdog here covers what hyper does not:
//! - a connection that sends nothing at all (hyper waits for the first bytes to tell the
//!   protocol, with no deadline) is closed after the same time;
//! - an HTTP/2 connection with no traffic either way for that long is shut down gracefully
//!   (requests in progress finish; the client opens a new connection for the next);
//! - a client that stops reading its answer (the socket stays full) for
//!   `--stream-idle-timeout-seconds` is disconnected, which releases its request and the
//!   engine connection (hyper stops polling an answer whose client does not read, so no
//!   deadline inside the answer could fire).

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::config::Deadlines;
use crate::errors::ErrorKind;
use crate::observe::metrics::RouterMetrics;

/// Progress on one connection, in milliseconds since it was accepted.
#[derive(Debug)]
struct Activity {
    accepted: Instant,
    last_read_ms: AtomicU64,
    last_write_ms: AtomicU64,
    /// 1 + the time a write first found the socket full, 0 while writes go through.
    write_blocked_since_ms: AtomicU64,
    read_any: AtomicBool,
    /// Requests on this connection not yet answered in full.
    waiting: AtomicUsize,
}

impl Activity {
    fn new() -> Self {
        Self {
            accepted: Instant::now(),
            last_read_ms: AtomicU64::new(0),
            last_write_ms: AtomicU64::new(0),
            write_blocked_since_ms: AtomicU64::new(0),
            read_any: AtomicBool::new(false),
            waiting: AtomicUsize::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.accepted.elapsed().as_millis() as u64
    }
}

/// The client's socket, noting when bytes move either way.
pub struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl Watched {
    fn wrote(&self, written: &Poll<io::Result<usize>>) {
        match written {
            Poll::Ready(Ok(n)) if *n > 0 => {
                let now = self.activity.now_ms();
                self.activity.last_write_ms.store(now, Ordering::Relaxed);
                self.activity
                    .write_blocked_since_ms
                    .store(0, Ordering::Relaxed);
            }
            Poll::Pending => {
                let since = self.activity.now_ms() + 1;
                let _ = self.activity.write_blocked_since_ms.compare_exchange(
                    0,
                    since,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            _ => {}
        }
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity
                .last_read_ms
                .store(this.activity.now_ms(), Ordering::Relaxed);
            this.activity.read_any.store(true, Ordering::Relaxed);
        }
        polled
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.wrote(&written);
        written
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.wrote(&written);
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Wraps an accepted socket and the service that answers it; the returned watch goes to
/// [`drive`].
pub fn watch(socket: TcpStream, app: axum::Router) -> (Watched, Counted, Watch) {
    let activity = Arc::new(Activity::new());
    (
        Watched {
            inner: socket,
            activity: Arc::clone(&activity),
        },
        Counted {
            inner: TowerToHyperService::new(app),
            activity: Arc::clone(&activity),
        },
        Watch { activity },
    )
}

/// The router's service, counting the requests of one connection until their answer is sent
/// in full (a long non-streaming answer moves no bytes while it is computed).
#[derive(Clone)]
pub struct Counted {
    inner: TowerToHyperService<axum::Router>,
    activity: Arc<Activity>,
}

struct Waiting(Arc<Activity>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

type Answer = http::Response<axum::body::Body>;

impl hyper::service::Service<http::Request<hyper::body::Incoming>> for Counted {
    type Response = Answer;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Answer, Self::Error>> + Send>>;

    fn call(&self, request: http::Request<hyper::body::Incoming>) -> Self::Future {
        self.activity.waiting.fetch_add(1, Ordering::Relaxed);
        let waiting = Waiting(Arc::clone(&self.activity));
        let answer = self.inner.call(request);
        Box::pin(async move {
            let answer = answer.await?;
            Ok(answer.map(|body| {
                axum::body::Body::new(Counting {
                    body,
                    _waiting: waiting,
                })
            }))
        })
    }
}

/// An answer's body, holding its request's place in the count until sent or dropped.
struct Counting {
    body: axum::body::Body,
    _waiting: Waiting,
}

impl http_body::Body for Counting {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// The watchdog's view of one connection.
pub struct Watch {
    activity: Arc<Activity>,
}

/// What the watchdog decided.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Fine,
    /// Quiet for the header deadline: shut down gracefully (requests in progress finish).
    Quiet,
    /// Never sent a byte, or stopped reading its answer: close now.
    Close(&'static str),
}

impl Watch {
    fn verdict(&self, deadlines: &Deadlines) -> Verdict {
        let activity = &self.activity;
        let now = activity.now_ms();
        let blocked = activity.write_blocked_since_ms.load(Ordering::Relaxed);
        if blocked > 0 && now + 1 - blocked >= deadlines.stream_idle.as_millis() as u64 {
            return Verdict::Close("the client stopped reading its answer");
        }
        let last = activity
            .last_read_ms
            .load(Ordering::Relaxed)
            .max(activity.last_write_ms.load(Ordering::Relaxed));
        let quiet = now - last;
        let header = deadlines.client_header.as_millis() as u64;
        if quiet < header {
            return Verdict::Fine;
        }
        if !activity.read_any.load(Ordering::Relaxed) {
            return Verdict::Close("the client sent nothing");
        }
        // Still quiet long after the graceful shutdown was asked, and no request is being
        // answered: a handshake or a client that never finishes (an HTTP/2 preface without
        // its settings, say).
        if quiet >= 2 * header && activity.waiting.load(Ordering::Relaxed) == 0 {
            return Verdict::Close("the connection stayed idle after its shutdown");
        }
        Verdict::Quiet
    }
}

/// A client connection as hyper serves it.
pub type ClientConnection = hyper_util::server::conn::auto::Connection<
    'static,
    hyper_util::rt::TokioIo<Watched>,
    Counted,
    hyper_util::rt::TokioExecutor,
>;

/// Drives `connection` to its end, under the watchdog and the router's shutdown.
pub async fn drive(
    connection: ClientConnection,
    watch: Watch,
    deadlines: Deadlines,
    stop: CancellationToken,
    metrics: Arc<RouterMetrics>,
) {
    let connection = std::pin::pin!(connection);
    let mut connection = connection;
    let period = (deadlines.client_header.min(deadlines.stream_idle) / 4)
        .clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut shutting_down = false;
    loop {
        tokio::select! {
            _ = connection.as_mut() => return,
            () = stop.cancelled(), if !shutting_down => {
                connection.as_mut().graceful_shutdown();
                shutting_down = true;
            }
            () = tokio::time::sleep(period) => match watch.verdict(&deadlines) {
                Verdict::Fine => {}
                Verdict::Quiet => {
                    if !shutting_down {
                        connection.as_mut().graceful_shutdown();
                        shutting_down = true;
                    }
                }
                Verdict::Close(why) => {
                    // Requests still in progress end with the connection.
                    if why.starts_with("the client stopped reading") {
                        metrics.error(ErrorKind::ClientStalled);
                        tracing::warn!(why, "closing a client connection");
                    } else {
                        tracing::debug!(why, "closing a client connection");
                    }
                    return;
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deadlines() -> Deadlines {
        Deadlines {
            connect: Duration::from_secs(1),
            upstream_idle: Duration::from_secs(1),
            client_header: Duration::from_millis(100),
            client_body: Duration::from_secs(1),
            upstream_header: Duration::from_secs(1),
            stream_idle: Duration::from_millis(200),
        }
    }

    /// A connection accepted 250 ms ago, with this history.
    fn watch_at(read_any: bool, last_read: u64, last_write: u64, blocked: u64) -> Watch {
        let activity = Activity {
            accepted: Instant::now() - Duration::from_millis(250),
            ..Activity::new()
        };
        activity.read_any.store(read_any, Ordering::Relaxed);
        activity.last_read_ms.store(last_read, Ordering::Relaxed);
        activity.last_write_ms.store(last_write, Ordering::Relaxed);
        activity
            .write_blocked_since_ms
            .store(blocked, Ordering::Relaxed);
        Watch {
            activity: Arc::new(activity),
        }
    }

    #[test]
    fn verdicts_follow_the_deadlines() {
        // Silent from the start: closed.
        assert!(matches!(
            watch_at(false, 0, 0, 0).verdict(&deadlines()),
            Verdict::Close(_)
        ));
        // Spoke once, quiet since: shut down gracefully; closed once quiet for longer, unless
        // a request waits for its answer.
        let quiet = watch_at(true, 100, 0, 0);
        assert_eq!(quiet.verdict(&deadlines()), Verdict::Quiet);
        let abandoned = watch_at(true, 0, 0, 0);
        // 250 ms of quiet is over twice the 100 ms header deadline.
        assert!(matches!(abandoned.verdict(&deadlines()), Verdict::Close(_)));
        abandoned.activity.waiting.store(1, Ordering::Relaxed);
        assert_eq!(abandoned.verdict(&deadlines()), Verdict::Quiet);
        // Wrote a moment ago: fine.
        let recent = watch_at(true, 0, 0, 0);
        let now = recent.activity.now_ms();
        recent.activity.last_write_ms.store(now, Ordering::Relaxed);
        assert_eq!(recent.verdict(&deadlines()), Verdict::Fine);
        // A write blocked since the start (over 200 ms): closed, even though it wrote lately.
        recent
            .activity
            .write_blocked_since_ms
            .store(1, Ordering::Relaxed);
        assert!(matches!(recent.verdict(&deadlines()), Verdict::Close(_)));
    }
}
