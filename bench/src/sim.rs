//! The simulated engines as the benchmarks run them.

use switchyard_engine_sim::SimConfig;

/// The simulator as the benchmarks run it: defaults (one p5), with the time scale and cache
/// size given, a short grace period and little request recording.
pub fn bench_sim(time_scale: f64, kv_cache_blocks: usize) -> SimConfig {
    SimConfig {
        time_scale,
        kv_cache_blocks,
        record_requests: 16,
        shutdown_grace_s: 5.0,
        ..SimConfig::default()
    }
}

/// The router/control-plane load interval scaled with the clock: 100 ms of model time.
pub fn load_interval_for(time_scale: f64) -> u64 {
    ((100.0 * time_scale).round() as u64).clamp(10, 100)
}
