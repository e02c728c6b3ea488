//! Admission control: bounds on client connections, requests in flight and request-body
//! bytes held in memory, per router process (every serving thread shares one `Admission`).
//! A request beyond a bound is refused at once with 503 and `Retry-After`; nothing queues,
//! so a flood costs memory in proportion to the bounds, never more.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Admission limits, per router process (over all serving threads).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub max_in_flight: usize,
    pub max_buffered_bytes: u64,
}

/// Which bound refused something: the `limit` label of
/// `switchyard_router_admission_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Connections,
    InFlight,
    BufferedBytes,
}

impl Limit {
    pub const ALL: [Limit; 3] = [Limit::Connections, Limit::InFlight, Limit::BufferedBytes];

    pub fn as_str(self) -> &'static str {
        match self {
            Limit::Connections => "connections",
            Limit::InFlight => "in_flight",
            Limit::BufferedBytes => "buffered_bytes",
        }
    }
}

#[derive(Debug)]
pub struct Admission {
    limits: Limits,
    connections: AtomicUsize,
    /// Connections being answered 503 because `connections` is full (bounded too).
    refusing: AtomicUsize,
    in_flight: AtomicUsize,
    buffered_bytes: AtomicU64,
    refused: [AtomicU64; 3],
}

impl Admission {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            connections: AtomicUsize::new(0),
            refusing: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            buffered_bytes: AtomicU64::new(0),
            refused: Default::default(),
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// A slot for one client connection, or `None` when `--max-connections` are open.
    pub fn connection(self: &Arc<Self>) -> Option<ConnectionPermit> {
        take(&self.connections, self.limits.max_connections).map(|()| ConnectionPermit {
            admission: Arc::clone(self),
        })
    }

    /// A slot for answering an excess connection with a 503 (at most a sixteenth of
    /// `--max-connections`, and at least 16); `None` means close it without a word.
    pub fn refusal(self: &Arc<Self>) -> Option<RefusalPermit> {
        self.count_refused(Limit::Connections);
        let most = (self.limits.max_connections / 16).max(16);
        take(&self.refusing, most).map(|()| RefusalPermit {
            admission: Arc::clone(self),
        })
    }

    /// A slot for one request, or `None` when `--max-in-flight` requests are in flight.
    pub fn request(self: &Arc<Self>) -> Option<RequestPermit> {
        match take(&self.in_flight, self.limits.max_in_flight) {
            Some(()) => Some(RequestPermit {
                admission: Arc::clone(self),
            }),
            None => {
                self.count_refused(Limit::InFlight);
                None
            }
        }
    }

    /// An empty reservation of body bytes, grown as the body arrives.
    pub fn buffer(self: &Arc<Self>) -> BufferReservation {
        BufferReservation {
            admission: Arc::clone(self),
            bytes: 0,
        }
    }

    pub fn count_refused(&self, limit: Limit) {
        self.refused[limit as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn refused(&self, limit: Limit) -> u64 {
        self.refused[limit as usize].load(Ordering::Relaxed)
    }

    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn buffered_bytes(&self) -> u64 {
        self.buffered_bytes.load(Ordering::Relaxed)
    }
}

/// Takes one unit of `counter` if it stays within `most`.
fn take(counter: &AtomicUsize, most: usize) -> Option<()> {
    counter
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
            (now < most).then_some(now + 1)
        })
        .ok()
        .map(|_| ())
}

#[derive(Debug)]
pub struct ConnectionPermit {
    admission: Arc<Admission>,
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        self.admission.connections.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug)]
pub struct RefusalPermit {
    admission: Arc<Admission>,
}

impl Drop for RefusalPermit {
    fn drop(&mut self) {
        self.admission.refusing.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One request in flight; released when dropped (the response's last byte, an error, or the
/// client going away).
#[derive(Debug)]
pub struct RequestPermit {
    admission: Arc<Admission>,
}

impl Drop for RequestPermit {
    fn drop(&mut self) {
        self.admission.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Request-body bytes counted against `--max-buffered-bytes` while the body is held.
#[derive(Debug)]
pub struct BufferReservation {
    admission: Arc<Admission>,
    bytes: u64,
}

impl BufferReservation {
    /// Grows the reservation to `total` bytes; false (and unchanged) if that would pass
    /// the bound.
    pub fn grow_to(&mut self, total: u64) -> bool {
        let granted = self.grow_within(total);
        if !granted {
            self.admission.count_refused(Limit::BufferedBytes);
        }
        granted
    }

    /// [`grow_to`](Self::grow_to) for memory the request can do without (a disaggregated
    /// request's prefill copy): not counted as a refusal when it fails.
    pub fn grow_within(&mut self, total: u64) -> bool {
        if total <= self.bytes {
            return true;
        }
        let more = total - self.bytes;
        let most = self.admission.limits.max_buffered_bytes;
        let granted = self
            .admission
            .buffered_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(more).filter(|next| *next <= most)
            })
            .is_ok();
        if granted {
            self.bytes = total;
        }
        granted
    }

    /// Sets the reservation to `total` bytes, within the bound or not: for a body whose
    /// final size is known (shrinking it, or a `model` rewrite a few bytes longer).
    pub fn resize_to(&mut self, total: u64) {
        let buffered = &self.admission.buffered_bytes;
        if total >= self.bytes {
            buffered.fetch_add(total - self.bytes, Ordering::AcqRel);
        } else {
            buffered.fetch_sub(self.bytes - total, Ordering::AcqRel);
        }
        self.bytes = total;
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for BufferReservation {
    fn drop(&mut self) {
        self.admission
            .buffered_bytes
            .fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(max: usize, bytes: u64) -> Arc<Admission> {
        Arc::new(Admission::new(Limits {
            max_connections: max,
            max_in_flight: max,
            max_buffered_bytes: bytes,
        }))
    }

    #[test]
    fn permits_stop_at_the_limit_and_come_back_when_dropped() {
        let admission = admission(2, 0);
        let first = admission.request().unwrap();
        let _second = admission.request().unwrap();
        assert!(admission.request().is_none());
        assert_eq!(admission.refused(Limit::InFlight), 1);
        drop(first);
        assert!(admission.request().is_some());
        let connections: Vec<_> = (0..2).filter_map(|_| admission.connection()).collect();
        assert_eq!(connections.len(), 2);
        assert!(admission.connection().is_none());
        drop(connections);
        assert_eq!(admission.connections(), 0);
    }

    #[test]
    fn reservations_share_one_byte_budget() {
        let admission = admission(1, 100);
        let mut a = admission.buffer();
        let mut b = admission.buffer();
        assert!(a.grow_to(60));
        assert!(!b.grow_to(41), "60 + 41 is over 100");
        assert_eq!(b.bytes(), 0);
        assert!(b.grow_to(40));
        assert!(a.grow_to(60), "growing to what is held is free");
        assert_eq!(admission.buffered_bytes(), 100);
        drop(a);
        assert_eq!(admission.buffered_bytes(), 40);
        drop(b);
        assert_eq!(admission.buffered_bytes(), 0);
        assert_eq!(admission.refused(Limit::BufferedBytes), 1);
    }

    #[test]
    fn limits_hold_under_concurrent_takers() {
        let admission = admission(50, 0);
        let held: Vec<RequestPermit> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let admission = Arc::clone(&admission);
                    scope.spawn(move || {
                        (0..100)
                            .filter_map(|_| admission.request())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|handle| handle.join().unwrap())
                .collect()
        });
        assert_eq!(held.len(), 50);
        assert_eq!(admission.in_flight(), 50);
    }
}
