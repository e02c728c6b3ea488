//! The hasher of the index's maps keyed by the router's block hashes.
//!
//! Those keys are already xxh3 outputs, so SipHash (std's default) only adds its cost to every
//! block of every walk. One multiply with a key drawn at random per process, folded, spreads
//! them as well; the key keeps a client who can compute xxh3 (the seed is public, see
//! docs/kv-events.md) from choosing prompts whose blocks share a bucket. It is not meant to
//! hold against someone who can read the hashes out of the process.

use std::hash::{BuildHasher, Hasher};

/// Builds [`BlockHasher`]s with this process's key.
#[derive(Debug, Clone, Copy)]
pub struct BlockHashing {
    key: u64,
}

impl Default for BlockHashing {
    fn default() -> Self {
        static KEY: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let key = *KEY.get_or_init(|| {
            // std's RandomState is seeded from the OS once per process.
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u64(0x5157_4954_4348_5944);
            hasher.finish() | 1
        });
        Self { key }
    }
}

impl BlockHashing {
    /// With a chosen key (tests: the default's key is random).
    #[cfg(test)]
    fn with_key(key: u64) -> Self {
        Self { key: key | 1 }
    }
}

impl BuildHasher for BlockHashing {
    type Hasher = BlockHasher;

    fn build_hasher(&self) -> BlockHasher {
        BlockHasher {
            key: self.key,
            state: 0,
        }
    }
}

/// See the module docs. Keys other than one `u64` are folded in eight bytes at a time.
#[derive(Debug, Clone, Copy)]
pub struct BlockHasher {
    key: u64,
    state: u64,
}

impl BlockHasher {
    fn mix(&mut self, value: u64) {
        let product = u128::from(self.state ^ value ^ self.key) * u128::from(self.key);
        self.state = (product as u64) ^ ((product >> 64) as u64);
    }
}

impl Hasher for BlockHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.mix(value);
    }

    fn finish(&self) -> u64 {
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_differing_in_one_bit_land_in_different_buckets() {
        // A fixed key: with the random one, two of 64 hashes share their top seven bits now
        // and then, as any good hash's do.
        let hashing = BlockHashing::with_key(0x9e37_79b9_7f4a_7c15);
        let hash = |value: u64| hashing.hash_one(value);
        // The low bits pick a bucket: each flipped bit moves the key to another one.
        let mut top_bits_differ = 0;
        for bit in 0..64 {
            let (a, b) = (hash(0x1234_5678), hash(0x1234_5678 ^ (1 << bit)));
            assert_ne!(a & 0xffff, b & 0xffff, "bit {bit}");
            top_bits_differ += u32::from(a >> 57 != b >> 57);
        }
        assert!(top_bits_differ >= 60, "{top_bits_differ} of 64");
        assert_eq!(hash(7), hash(7));
        assert_ne!(
            BlockHashing::default().hash_one(7u64),
            BlockHashing::with_key(2).hash_one(7u64)
        );
    }
}
