//! Prefix extraction for the native API and validation of the prefix-aware id.

/// The native API's routing prefix: the first `prefix_length` bytes of the raw body, exactly as
/// sent (whitespace and key order included, as in SageMaker).
pub fn native(body: &[u8], prefix_length: usize) -> &[u8] {
    &body[..body.len().min(prefix_length)]
}

/// `X-Amzn-SageMaker-Prefix-Aware-Id` (and `prompt_cache_key`): 1-64 printable ASCII
/// characters (0x20-0x7E).
pub fn valid_prefix_aware_id(id: &[u8]) -> bool {
    (1..=64).contains(&id.len()) && id.iter().all(|byte| (0x20..=0x7e).contains(byte))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_prefix_is_bytes() {
        assert_eq!(native(b"abcdef", 4), b"abcd");
        assert_eq!(native(b"ab", 4), b"ab");
    }

    #[test]
    fn prefix_aware_ids() {
        assert!(valid_prefix_aware_id(b"tenant-42"));
        assert!(valid_prefix_aware_id(&[b'x'; 64]));
        assert!(!valid_prefix_aware_id(b""));
        assert!(!valid_prefix_aware_id(&[b'x'; 65]));
        assert!(!valid_prefix_aware_id(b"tab\there"));
        assert!(!valid_prefix_aware_id("é".as_bytes()));
    }
}
