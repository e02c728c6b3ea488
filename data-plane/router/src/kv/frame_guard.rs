//! A loopback relay in front of an engine's KV-event sockets that reads the ZMTP framing the
//! engine sends and cuts the connection at a frame longer than [`MAX_FRAME_BYTES`].
//!
//! zeromq 0.7 reserves memory for whatever frame length a peer announces before any of the
//! frame arrives: one 9-byte header claiming 2^40 bytes aborts the router. The router's SUB and
//! DEALER sockets therefore dial this relay (`tcp://127.0.0.1:PORT`), which dials the engine
//! and passes the engine's bytes on only once each frame header is known to be within bounds
//! (the router's own bytes go out unread). A cut looks to the ZMQ socket like a lost
//! connection: it reconnects, and the subscriber's restart rule applies.
//!
//! The same relay guards a socket the router binds for others to dial (LMCACHE_PD's notice
//! socket, [`serve_inbound`]): it listens where the socket would, binds the socket on loopback
//! behind it, and reads what each dialler sends with a much smaller bound. A dialler that
//! oversteps loses its connection; nobody else's is refused.
//!
//! ZMTP 3 (rfc.zeromq.org/spec/23): a 64-byte greeting, then frames of a flags byte (bit 1:
//! an 8-byte length follows, else a 1-byte one; bit 2: a command), the length (big-endian) and
//! the body.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// The longest frame, and message (its frames together), an engine may send: far above any
/// batch of KV events (vLLM's are a few KB to a few MB) and far below what allocating would
/// hurt.
pub const MAX_FRAME_BYTES: u64 = 256 * 1024 * 1024;

/// How long the relay waits to reach the engine for one connection of the router's socket.
const DIAL_TIMEOUT: Duration = Duration::from_secs(2);

/// After a cut, connections are refused for this long, doubling with each further cut up to
/// [`MOST_HOLD`]: an engine that keeps overstepping is not resynchronised every 100 ms.
const FIRST_HOLD: Duration = Duration::from_secs(1);
const MOST_HOLD: Duration = Duration::from_secs(60);

const GREETING_BYTES: u64 = 64;

/// Which side's bytes the relay reads against the bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Checked {
    /// The side it dials (an engine's socket): the router's socket dials the relay.
    Dialled,
    /// The side that dials it (a peer of a socket the router binds behind it).
    Accepted,
}

/// A running relay to one engine socket; it stops when dropped.
#[derive(Debug)]
pub struct FrameGuard {
    /// What the router's ZMQ socket dials instead of the engine.
    pub endpoint: String,
    stop: CancellationToken,
}

impl Drop for FrameGuard {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Starts a relay to `target` (`tcp://HOST:PORT`, as registered). `None` when `target` is not
/// a TCP endpoint or no loopback port can be had: the socket then dials `target` itself.
pub async fn start(target: &str, instance: &str) -> Option<FrameGuard> {
    let address = target.strip_prefix("tcp://")?;
    let listener = match TcpListener::bind("127.0.0.1:0").await {
        Ok(listener) => listener,
        Err(err) => {
            tracing::warn!(instance, error = %err, "no loopback port for the KV-event frame guard; dialling the engine directly");
            return None;
        }
    };
    let local: SocketAddr = listener.local_addr().ok()?;
    let stop = CancellationToken::new();
    let relay = Relay {
        target: address.to_owned(),
        instance: instance.to_owned(),
        hold: Some(Mutex::new(Hold::default())),
        checked: Checked::Dialled,
        most: MAX_FRAME_BYTES,
    };
    tokio::spawn(relay.accept(listener, stop.clone()));
    Some(FrameGuard {
        endpoint: format!("tcp://{local}"),
        stop,
    })
}

/// Listens on `listener` for others' connections to a socket bound at `target`
/// (`HOST:PORT`, on loopback), relaying each one there and cutting it at a frame or message
/// longer than `most` bytes. `what` names the socket in logs. Runs until `stop`.
pub async fn serve_inbound(
    listener: TcpListener,
    target: String,
    what: &str,
    most: u64,
    stop: CancellationToken,
) {
    let relay = Relay {
        target,
        instance: what.to_owned(),
        hold: None,
        checked: Checked::Accepted,
        most,
    };
    relay.accept(listener, stop).await;
}

struct Relay {
    /// `HOST:PORT` of the engine's socket (or of the router's own, inbound).
    target: String,
    instance: String,
    /// Refusals after a cut (None inbound: one dialler's cut must not refuse the others).
    hold: Option<Mutex<Hold>>,
    checked: Checked,
    /// The longest frame, and message, the checked side may send.
    most: u64,
}

/// Connections refused after cuts: until when, and the next hold's length.
#[derive(Debug, Default)]
struct Hold {
    until: Option<Instant>,
    next: Duration,
}

impl Relay {
    async fn accept(self, listener: TcpListener, stop: CancellationToken) {
        let relay = std::sync::Arc::new(self);
        loop {
            let accepted = tokio::select! {
                () = stop.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            let Ok((inbound, _)) = accepted else {
                // Out of file descriptors, most likely: wait rather than spin.
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
                }
                continue;
            };
            let (relay, stop) = (std::sync::Arc::clone(&relay), stop.clone());
            tokio::spawn(async move {
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = relay.connection(inbound) => {}
                }
            });
        }
    }

    /// One connection of the router's socket: the engine's side dialled, bytes both ways until
    /// either side closes or the engine oversteps.
    async fn connection(&self, inbound: TcpStream) {
        if self.held() {
            // Dropped: the ZMQ socket tries again later.
            return;
        }
        let outbound = match tokio::time::timeout(
            DIAL_TIMEOUT,
            TcpStream::connect(self.target.as_str()),
        )
        .await
        {
            Ok(Ok(outbound)) => outbound,
            Ok(Err(err)) => {
                tracing::debug!(instance = %self.instance, target = %self.target, error = %err, "the socket behind the frame guard is not reachable");
                // Dropping `inbound` tells the ZMQ socket the engine is not there yet.
                return;
            }
            Err(_) => {
                tracing::debug!(instance = %self.instance, target = %self.target, "the socket behind the frame guard: dial timed out");
                return;
            }
        };
        let _ = inbound.set_nodelay(true);
        let _ = outbound.set_nodelay(true);
        let (accepted, dialled) = (inbound.into_split(), outbound.into_split());
        // The checked side's bytes are read frame by frame on their way to the other side;
        // the other side's go to it unread.
        let ((mut checked_read, mut to_checked), (mut other_read, mut to_other)) =
            match self.checked {
                Checked::Dialled => (dialled, accepted),
                Checked::Accepted => (accepted, dialled),
            };
        let upstream = tokio::io::copy(&mut other_read, &mut to_checked);
        let downstream = async {
            let mut framing = Framing::with_most(self.most);
            // Small: one relay per engine socket, two sockets per engine of a fleet.
            let mut buffer = vec![0u8; 16 * 1024];
            loop {
                let read = match checked_read.read(&mut buffer).await {
                    Ok(0) | Err(_) => return,
                    Ok(read) => read,
                };
                if let Err(length) = framing.check(&buffer[..read]) {
                    match self.cut() {
                        Some(hold) => {
                            tracing::warn!(instance = %self.instance, length, most = self.most, hold_s = hold.as_secs(), "the engine's KV-event socket announced a frame or message too long to accept; connection cut, and refused for a while");
                        }
                        None => {
                            tracing::warn!(socket = %self.instance, length, most = self.most, "a peer announced a frame or message too long to accept; its connection cut");
                        }
                    }
                    return;
                }
                if to_other.write_all(&buffer[..read]).await.is_err() {
                    return;
                }
            }
        };
        tokio::select! {
            _ = upstream => {}
            () = downstream => {}
        }
    }
}

impl Relay {
    /// Whether connections are refused for now (after a cut).
    fn held(&self) -> bool {
        let Some(hold) = &self.hold else {
            return false;
        };
        let hold = hold
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        hold.until.is_some_and(|until| Instant::now() < until)
    }

    /// A cut: connections refused for the next hold, which doubles. Returns its length (None
    /// for a relay that never refuses).
    fn cut(&self) -> Option<Duration> {
        let mut hold = self
            .hold
            .as_ref()?
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let length = hold.next.max(FIRST_HOLD);
        hold.until = Some(Instant::now() + length);
        hold.next = (length * 2).min(MOST_HOLD);
        Some(length)
    }
}

/// Where the engine's byte stream is in the ZMTP framing.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Bytes of the greeting seen so far.
    #[default]
    Greeting,
    /// A frame's flags byte is next.
    Flags,
    /// Reading a length of `width` bytes, `seen` of them so far, into `value`.
    Length { width: u8, seen: u8, value: u64 },
    /// `left` bytes of a frame body remain.
    Body { left: u64 },
}

#[derive(Debug)]
struct Framing {
    /// The longest frame, and message.
    most: u64,
    state: State,
    greeting_seen: u64,
    /// The current message's frames so far (bytes), and whether its current frame has MORE.
    message: u64,
    more: bool,
}

impl Default for Framing {
    fn default() -> Self {
        Self::with_most(MAX_FRAME_BYTES)
    }
}

impl Framing {
    fn with_most(most: u64) -> Self {
        Self {
            most,
            state: State::default(),
            greeting_seen: 0,
            message: 0,
            more: false,
        }
    }

    /// Follows `bytes`; `Err(length)` at a frame or message announced longer than `most`.
    fn check(&mut self, mut bytes: &[u8]) -> Result<(), u64> {
        while !bytes.is_empty() {
            match self.state {
                State::Greeting => {
                    let take = (GREETING_BYTES - self.greeting_seen).min(bytes.len() as u64);
                    self.greeting_seen += take;
                    bytes = &bytes[take as usize..];
                    if self.greeting_seen == GREETING_BYTES {
                        self.state = State::Flags;
                    }
                }
                State::Flags => {
                    let long = bytes[0] & 0b10 != 0;
                    // A command frame stands alone; a message frame with MORE is continued.
                    self.more = bytes[0] & 0b101 == 0b001;
                    bytes = &bytes[1..];
                    self.state = State::Length {
                        width: if long { 8 } else { 1 },
                        seen: 0,
                        value: 0,
                    };
                }
                State::Length { width, seen, value } => {
                    let value = (value << 8) | u64::from(bytes[0]);
                    bytes = &bytes[1..];
                    let seen = seen + 1;
                    if seen < width {
                        self.state = State::Length { width, seen, value };
                        continue;
                    }
                    self.message = self.message.saturating_add(value);
                    if value > self.most || self.message > self.most {
                        return Err(self.message.max(value));
                    }
                    if !self.more {
                        // The message ends with this frame.
                        self.message = 0;
                    }
                    self.state = if value == 0 {
                        State::Flags
                    } else {
                        State::Body { left: value }
                    };
                }
                State::Body { left } => {
                    let take = left.min(bytes.len() as u64);
                    bytes = &bytes[take as usize..];
                    self.state = if take == left {
                        State::Flags
                    } else {
                        State::Body { left: left - take }
                    };
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greeting() -> Vec<u8> {
        let mut greeting = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0];
        greeting.extend_from_slice(b"NULL");
        greeting.resize(64, 0);
        greeting
    }

    #[test]
    fn frames_within_bounds_pass_whatever_the_chunking() {
        let mut stream = greeting();
        // A short command frame (READY), a short message frame, a long one of 300 bytes.
        stream.extend_from_slice(&[0x04, 2, b'o', b'k']);
        stream.extend_from_slice(&[0x01, 1, b'x']);
        stream.push(0x02);
        stream.extend_from_slice(&300u64.to_be_bytes());
        stream.extend(std::iter::repeat_n(7, 300));
        stream.extend_from_slice(&[0x00, 0]);
        for chunk in [1, 3, 9, 64, 65, stream.len()] {
            let mut framing = Framing::default();
            for piece in stream.chunks(chunk) {
                framing.check(piece).unwrap();
            }
            assert_eq!(framing.state, State::Flags, "chunks of {chunk}");
        }
    }

    #[test]
    fn a_frame_announced_too_long_is_refused_before_its_body() {
        let mut stream = greeting();
        stream.push(0x02);
        stream.extend_from_slice(&(1u64 << 40).to_be_bytes());
        let mut framing = Framing::default();
        assert_eq!(framing.check(&stream), Err(1 << 40));
        let mut at_the_bound = greeting();
        at_the_bound.push(0x06);
        at_the_bound.extend_from_slice(&MAX_FRAME_BYTES.to_be_bytes());
        assert_eq!(Framing::default().check(&at_the_bound), Ok(()));
    }

    #[test]
    fn a_message_of_many_frames_is_bounded_in_all() {
        let half = MAX_FRAME_BYTES / 2 + 1;
        let header = |flags: u8| {
            let mut header = vec![flags];
            header.extend_from_slice(&half.to_be_bytes());
            header
        };
        // A body, fed in pieces of 1 MiB.
        let body = |framing: &mut Framing| {
            let piece = vec![0u8; 1 << 20];
            let mut left = half;
            while left > 0 {
                let take = left.min(piece.len() as u64);
                framing.check(&piece[..take as usize]).unwrap();
                left -= take;
            }
        };
        // Two frames of one message (MORE on the first): over the bound together.
        let mut framing = Framing::default();
        framing.check(&greeting()).unwrap();
        framing.check(&header(0x03)).unwrap();
        body(&mut framing);
        assert_eq!(framing.check(&header(0x02)), Err(2 * half));
        // The same two frames as two messages: each within it.
        let mut framing = Framing::default();
        framing.check(&greeting()).unwrap();
        for _ in 0..2 {
            framing.check(&header(0x02)).unwrap();
            body(&mut framing);
        }
    }
}
