//! Fault injection: seeded, so a test run misbehaves the same way every time.

use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// Fault knobs, settable by flag, by `SimHandle::set_faults`
/// or by `POST /sim/faults` with this JSON (missing fields are 0). Each rate is the
/// probability, drawn per inference request, of that fault; they are checked in the order
/// fail, hang, die, stall.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Answer 500 with an OpenAI-style error body.
    pub fail_rate: f64,
    /// Accept the request and never answer it; the client has to give up.
    pub hang_rate: f64,
    /// Close the connection after a few streamed tokens (non-streaming: before the body).
    pub die_mid_stream_rate: f64,
    /// Stream a few tokens, then send nothing more while keeping the connection open
    /// (non-streaming: send the response head, then nothing).
    pub stall_mid_stream_rate: f64,
    /// After a few streamed tokens, end the stream with vLLM's error event (an internal error,
    /// code 500) and `[DONE]`, as vLLM does when its engine core fails under a request
    /// (non-streaming: answer 500). Drawn apart from the four above, for streams only.
    pub error_mid_stream_rate: f64,
    /// `POST /tokenize` (drawn per tokenize request, apart from inference requests): answer
    /// 500.
    pub tokenize_fail_rate: f64,
    /// `POST /tokenize`: accept and never answer.
    pub tokenize_hang_rate: f64,
    /// A decode engine's pull of a disaggregated request's KV cache (drawn per pull, apart
    /// from the other draws): fails, as a NIXL transfer error would; the request then fails
    /// or is recomputed as `--kv-load-failure-policy` says.
    pub kv_pull_fail_rate: f64,
}

impl Faults {
    /// Each rate must be within 0–1; the error names the flag (and JSON field).
    pub fn validate(&self) -> Result<(), FaultRateError> {
        for (flag, field, value) in [
            ("--fail-rate", "fail_rate", self.fail_rate),
            ("--hang-rate", "hang_rate", self.hang_rate),
            (
                "--die-mid-stream-rate",
                "die_mid_stream_rate",
                self.die_mid_stream_rate,
            ),
            (
                "--stall-mid-stream-rate",
                "stall_mid_stream_rate",
                self.stall_mid_stream_rate,
            ),
            (
                "--error-mid-stream-rate",
                "error_mid_stream_rate",
                self.error_mid_stream_rate,
            ),
            (
                "--tokenize-fail-rate",
                "tokenize_fail_rate",
                self.tokenize_fail_rate,
            ),
            (
                "--tokenize-hang-rate",
                "tokenize_hang_rate",
                self.tokenize_hang_rate,
            ),
            (
                "--kv-pull-fail-rate",
                "kv_pull_fail_rate",
                self.kv_pull_fail_rate,
            ),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(FaultRateError { flag, field, value });
            }
        }
        Ok(())
    }
}

/// A fault rate outside 0–1, named by its flag and its JSON field.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("{flag} ({field}) must be between 0 and 1, got {value}")]
pub struct FaultRateError {
    pub flag: &'static str,
    pub field: &'static str,
    pub value: f64,
}

/// What to do to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    None,
    Fail,
    Hang,
    DieMidStream,
    StallMidStream,
}

/// What to do to one `/tokenize` request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TokenizeFault {
    None,
    Fail,
    Hang,
}

/// The current knobs and the seeded generators, drawn once per inference request (and, with
/// a generator of their own so that inference draws do not depend on them, once per
/// `/tokenize` request).
#[derive(Debug)]
pub(crate) struct FaultInjector {
    state: Mutex<(Faults, fastrand::Rng)>,
    tokenize: Mutex<fastrand::Rng>,
    kv_pull: Mutex<fastrand::Rng>,
    error_mid_stream: Mutex<fastrand::Rng>,
}

impl FaultInjector {
    pub(crate) fn new(faults: Faults, seed: u64) -> Self {
        Self {
            state: Mutex::new((faults, fastrand::Rng::with_seed(seed))),
            tokenize: Mutex::new(fastrand::Rng::with_seed(seed ^ 0x746f_6b65_6e69_7a65)),
            kv_pull: Mutex::new(fastrand::Rng::with_seed(seed ^ 0x6b76_5f70_756c_6c00)),
            error_mid_stream: Mutex::new(fastrand::Rng::with_seed(seed ^ 0x6572_726f_7200_0000)),
        }
    }

    pub(crate) fn set(&self, faults: Faults) {
        self.lock().0 = faults;
    }

    pub(crate) fn get(&self) -> Faults {
        self.lock().0
    }

    /// Draws the fault for the next `/tokenize` request (two draws every time).
    pub(crate) fn draw_tokenize(&self) -> TokenizeFault {
        let faults = self.get();
        let (fail, hang) = {
            let mut rng = self
                .tokenize
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            (rng.f64(), rng.f64())
        };
        if fail < faults.tokenize_fail_rate {
            TokenizeFault::Fail
        } else if hang < faults.tokenize_hang_rate {
            TokenizeFault::Hang
        } else {
            TokenizeFault::None
        }
    }

    /// Whether the next KV pull fails (one draw every time).
    pub(crate) fn draw_kv_pull_failure(&self) -> bool {
        draw(&self.kv_pull, self.get().kv_pull_fail_rate)
    }

    /// Whether a request served without another fault ends with an error event (one draw per
    /// such request, so the sequence still depends only on the seed, knobs and order).
    pub(crate) fn draw_error_mid_stream(&self) -> bool {
        draw(&self.error_mid_stream, self.get().error_mid_stream_rate)
    }

    /// Draws the fault for the next request. Four draws every time, so the sequence of
    /// outcomes depends only on the seed, the knobs and the order of requests.
    pub(crate) fn draw(&self) -> Fault {
        let mut state = self.lock();
        let (faults, rng) = &mut *state;
        let (fail, hang, die, stall) = (rng.f64(), rng.f64(), rng.f64(), rng.f64());
        if fail < faults.fail_rate {
            Fault::Fail
        } else if hang < faults.hang_rate {
            Fault::Hang
        } else if die < faults.die_mid_stream_rate {
            Fault::DieMidStream
        } else if stall < faults.stall_mid_stream_rate {
            Fault::StallMidStream
        } else {
            Fault::None
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Faults, fastrand::Rng)> {
        // The state stays consistent even if a holder panicked.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// One draw of `rng`: whether it falls below `rate`.
fn draw(rng: &Mutex<fastrand::Rng>, rate: f64) -> bool {
    let draw = rng
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .f64();
    draw < rate
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_deterministic_for_a_seed() {
        let faults = Faults {
            fail_rate: 0.3,
            hang_rate: 0.2,
            die_mid_stream_rate: 0.2,
            stall_mid_stream_rate: 0.5,
            ..Faults::default()
        };
        let a = FaultInjector::new(faults, 7);
        let b = FaultInjector::new(faults, 7);
        let draws_a: Vec<Fault> = (0..200).map(|_| a.draw()).collect();
        let draws_b: Vec<Fault> = (0..200).map(|_| b.draw()).collect();
        assert_eq!(draws_a, draws_b);
        let failures = draws_a.iter().filter(|f| **f == Fault::Fail).count();
        assert!((30..=90).contains(&failures), "{failures}");
        assert!(draws_a.contains(&Fault::Hang));
        assert!(draws_a.contains(&Fault::DieMidStream));
        assert!(draws_a.contains(&Fault::StallMidStream));
    }

    #[test]
    fn zero_and_one_rates_are_exact() {
        let never = FaultInjector::new(Faults::default(), 1);
        assert!((0..100).all(|_| never.draw() == Fault::None));
        never.set(Faults {
            fail_rate: 1.0,
            ..Faults::default()
        });
        assert!((0..100).all(|_| never.draw() == Fault::Fail));
        assert!((0..100).all(|_| never.draw_tokenize() == TokenizeFault::None));
        never.set(Faults {
            tokenize_hang_rate: 1.0,
            ..Faults::default()
        });
        assert!((0..100).all(|_| never.draw_tokenize() == TokenizeFault::Hang));
        assert!((0..100).all(|_| never.draw() == Fault::None));
    }

    #[test]
    fn validate_names_the_field() {
        let bad = Faults {
            hang_rate: -0.1,
            ..Faults::default()
        };
        assert_eq!(
            bad.validate().unwrap_err().to_string(),
            "--hang-rate (hang_rate) must be between 0 and 1, got -0.1"
        );
        assert_eq!(Faults::default().validate(), Ok(()));
    }
}
