//! Stable hashes. Every router, on every platform and every future version, must compute the
//! same routing key and the same ranking from the same input, so nothing here goes through
//! Rust's `Hash` trait (whose output may change between releases); everything is xxh3-64 over
//! explicitly laid out bytes.
//!
//! - Routing key = `xxh3_64(u64_le(len(id)) ‖ id ‖ prefix)`, seed 0, where `id` is the
//!   prefix-aware id (empty when absent) and `prefix` the extracted prefix bytes (UTF-8 for the
//!   OpenAI API). The length prefix keeps ("ab", "c") and ("a", "bc") apart.
//! - Instance hash = `xxh3_64(instance id bytes)`, seed 0, computed once per membership change.
//! - Rendezvous draw for (key, instance) = `xxh3_64(u64_le(key) ‖ u64_le(instance hash))`.

use xxhash_rust::xxh3::{Xxh3Default, xxh3_64};

/// The routing key of a request: prefix-aware id (may be empty) and prefix.
pub fn routing_key(prefix_aware_id: &[u8], prefix: &[u8]) -> u64 {
    let mut hasher = Xxh3Default::new();
    hasher.update(&(prefix_aware_id.len() as u64).to_le_bytes());
    hasher.update(prefix_aware_id);
    hasher.update(prefix);
    hasher.digest()
}

/// The key of a sticky session id (`X-Amzn-SageMaker-Session-Id`).
pub fn session_key(session_id: &[u8]) -> u64 {
    routing_key(b"session", session_id)
}

/// The key of a flow-control fairness id (`x-switchyard-fairness-id`, or the body's
/// `safety_identifier` / `user`).
pub fn fairness_key(fairness_id: &[u8]) -> u64 {
    routing_key(b"fairness", fairness_id)
}

/// The per-instance hash used in rendezvous ranking.
pub fn instance_hash(instance_id: &str) -> u64 {
    xxh3_64(instance_id.as_bytes())
}

/// A uniform draw in (0, 1) for (key, instance), the same on every router.
pub fn rendezvous_draw(key: u64, instance_hash: u64) -> f64 {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&key.to_le_bytes());
    bytes[8..].copy_from_slice(&instance_hash.to_le_bytes());
    let bits = xxh3_64(&bytes) >> 11; // 53 bits
    (bits as f64 + 0.5) / (1u64 << 53) as f64
}

/// Weighted rendezvous score: the highest score wins. With draw u in (0,1) and weight w,
/// `w / -ln(u)` makes an instance win with probability w / Σw, and removing or adding one
/// instance moves only the keys that instance wins or loses.
pub fn rendezvous_score(key: u64, instance_hash: u64, weight: f64) -> f64 {
    let draw = rendezvous_draw(key, instance_hash);
    weight / -draw.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Golden vectors: if one of these changes, routers of different versions would disagree
    /// about where a prefix lives. Never update them without a migration plan. The values were
    /// cross-checked with an independent implementation (Python's `xxhash` package:
    /// `xxh3_64_intdigest(struct.pack('<Q', len(id)) + id + prefix)`).
    #[test]
    fn golden_vectors() {
        assert_eq!(routing_key(b"", b""), 0xc77b_3abb_6f87_acd9);
        assert_eq!(routing_key(b"", b"hello"), 0xa4d9_5f0c_1f44_ff5b);
        assert_eq!(routing_key(b"tenant-a", b"hello"), 0x229f_8ac9_6111_a64e);
        assert_eq!(instance_hash("engine-0"), 0x1c1c_cf1c_628f_2563);
    }

    /// The draw decides the rendezvous order, so its exact values are golden too (as bits of
    /// the f64; cross-checked with Python's `xxhash` 4.1: `((xxh3_64_intdigest(struct.pack(
    /// '<QQ', key, instance_hash)) >> 11) + 0.5) / 2**53`).
    #[test]
    fn golden_draws() {
        assert_eq!(rendezvous_draw(0, 0).to_bits(), 0x3fea_14cd_4cb8_ea52);
        assert_eq!(
            rendezvous_draw(7, instance_hash("engine-0")).to_bits(),
            0x3fee_386f_2d85_87e2
        );
        assert_eq!(
            rendezvous_draw(u64::MAX, 42).to_bits(),
            0x3fcb_4783_22a5_5fc2
        );
    }

    #[test]
    fn session_keys_are_routing_keys_in_their_own_namespace() {
        assert_eq!(session_key(b"s-1"), routing_key(b"session", b"s-1"));
        assert_ne!(session_key(b"s-1"), session_key(b"s-2"));
        assert_ne!(session_key(b"s-1"), routing_key(b"", b"s-1"));
    }

    /// Routers share FairnessWeights by this key, so it must not collapse ids together nor
    /// meet a session's or a prefix's key.
    #[test]
    fn fairness_keys_are_routing_keys_in_their_own_namespace() {
        assert_eq!(fairness_key(b"team-a"), routing_key(b"fairness", b"team-a"));
        assert_ne!(fairness_key(b"team-a"), fairness_key(b"team-b"));
        assert_ne!(fairness_key(b"team-a"), session_key(b"team-a"));
        assert_ne!(fairness_key(b"team-a"), routing_key(b"", b"team-a"));
    }

    #[test]
    fn streaming_equals_one_shot_layout() {
        let id = b"tenant";
        let prefix = b"some prompt text";
        let mut layout = (id.len() as u64).to_le_bytes().to_vec();
        layout.extend_from_slice(id);
        layout.extend_from_slice(prefix);
        assert_eq!(routing_key(id, prefix), xxh3_64(&layout));
    }

    #[test]
    fn length_prefix_separates_id_from_prefix() {
        assert_ne!(routing_key(b"ab", b"c"), routing_key(b"a", b"bc"));
    }

    #[test]
    fn draws_are_inside_the_unit_interval() {
        for key in 0..1000u64 {
            let draw = rendezvous_draw(key, 42);
            assert!(draw > 0.0 && draw < 1.0);
        }
    }
}
