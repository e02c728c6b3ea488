//! How the benchmarks' flags override their defaults.

/// Replaces `target` with the flag's value when the flag was given.
pub fn set<T>(target: &mut T, flag: Option<T>) {
    if let Some(value) = flag {
        *target = value;
    }
}
