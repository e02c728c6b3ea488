//! The clocks every crate reads: the wall clock for times that leave the process (stored
//! records, OpenAI's `created`, KV-event timestamps, ejection deadlines) and a monotonic clock
//! for router-local memories that must never step.

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (0 if the clock reads earlier).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
        })
}

/// Whole seconds since the Unix epoch (OpenAI's `created`).
pub fn unix_seconds() -> u64 {
    unix_ms() / 1000
}

/// Seconds since the Unix epoch, with a fraction (vLLM's KV-event timestamps).
pub fn unix_seconds_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |elapsed| elapsed.as_secs_f64())
}

/// Milliseconds since this process first asked: a clock that never steps.
pub fn monotonic_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let elapsed = START.get_or_init(Instant::now).elapsed();
    u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clocks_move_forward() {
        let (wall, monotonic) = (unix_ms(), monotonic_ms());
        assert!(wall > 1_600_000_000_000, "{wall}");
        assert!(unix_seconds() >= wall / 1000);
        assert!(unix_seconds_f64() >= (wall / 1000) as f64);
        assert!(monotonic_ms() >= monotonic);
    }
}
