//! vLLM's KV-cache event payload (`vllm/distributed/kv_events.py`), decoded from msgpack.
//!
//! A `KVEventBatch` is msgspec `array_like`: `[ts, events, data_parallel_rank?]` (a map with
//! those keys is accepted too). Each event is msgspec `tag=True`, in one of two layouts, both
//! accepted so one router fronts a fleet mid-upgrade:
//!
//! - a positional array whose first element is the tag (vLLM up to 0.23): `["BlockStored",
//!   block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
//!   extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]`,
//!   `["BlockRemoved", block_hashes, medium, group_idx]`, `["AllBlocksCleared"]`;
//! - a map with the tag under `"type"` and the fields by name (later vLLM).
//!
//! `omit_defaults` means trailing fields at their default may be missing; fields this router
//! does not know (added by later versions) are skipped; block hashes are integers or bytes
//! depending on the engine's hash function. An unknown event tag is kept as
//! [`KvEvent::Other`] and ignored by the index.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// An engine's block hash, reduced to 64 bits: an integer hash as is, a bytes hash (vLLM's
/// sha256 hashes) by xxh3. Only ever compared with hashes of the same engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EngineHash(pub u64);

impl<'de> Deserialize<'de> for EngineHash {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct HashVisitor;
        impl Visitor<'_> for HashVisitor {
            type Value = EngineHash;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a block hash (integer or bytes)")
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<EngineHash, E> {
                Ok(EngineHash(value))
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<EngineHash, E> {
                // Python's hash() is signed: keep its bit pattern.
                Ok(EngineHash(value as u64))
            }
            fn visit_bytes<E: de::Error>(self, value: &[u8]) -> Result<EngineHash, E> {
                Ok(EngineHash(xxh3_64_with_seed(value, 0xb10c)))
            }
        }
        deserializer.deserialize_any(HashVisitor)
    }
}

/// Blocks that entered an engine's prefix cache: `block_hashes[i]` holds
/// `token_ids[i * block_size..(i + 1) * block_size]`, chained after `parent_block_hash`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<EngineHash>,
    pub parent_block_hash: Option<EngineHash>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// Per block: whether the engine mixed extra keys (multimodal inputs, a cache salt) into
    /// its hash. Empty when absent.
    pub extra_keys: Vec<bool>,
    pub group_idx: Option<i64>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<EngineHash>,
    pub medium: Option<String>,
    pub group_idx: Option<i64>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
    /// An event type this router does not know (its tag).
    Other(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Unix seconds at the engine.
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
}

/// Why a payload could not be read.
#[derive(Debug, thiserror::Error)]
#[error("unreadable KV event batch: {0}")]
pub struct DecodeError(#[from] rmp_serde::decode::Error);

/// Decodes one `KVEventBatch` payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    Ok(rmp_serde::from_slice(payload)?)
}

fn drain<'de, A: SeqAccess<'de>>(seq: &mut A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

impl<'de> Deserialize<'de> for EventBatch {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BatchVisitor;
        impl<'de> Visitor<'de> for BatchVisitor {
            type Value = EventBatch;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a KVEventBatch [ts, events, data_parallel_rank]")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EventBatch, A::Error> {
                let ts = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::missing_field("ts"))?;
                let events = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::missing_field("events"))?;
                let data_parallel_rank = seq.next_element::<Option<i64>>()?.flatten();
                drain(&mut seq)?;
                Ok(EventBatch {
                    ts,
                    events,
                    data_parallel_rank,
                })
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EventBatch, A::Error> {
                let (mut ts, mut events, mut rank) = (None, None, None);
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "ts" => ts = Some(map.next_value()?),
                        "events" => events = Some(map.next_value()?),
                        "data_parallel_rank" => rank = map.next_value()?,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(EventBatch {
                    ts: ts.ok_or_else(|| de::Error::missing_field("ts"))?,
                    events: events.ok_or_else(|| de::Error::missing_field("events"))?,
                    data_parallel_rank: rank,
                })
            }
        }
        deserializer.deserialize_any(BatchVisitor)
    }
}

/// `extra_keys`: per block, nil or a tuple; only whether each is present matters here.
fn extra_flags(extra: Option<Vec<Option<IgnoredAny>>>) -> Vec<bool> {
    extra
        .unwrap_or_default()
        .into_iter()
        .map(|entry| entry.is_some())
        .collect()
}

/// Every field an event may carry, gathered before the tag says which event it is.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<EngineHash>>,
    parent_block_hash: Option<EngineHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Vec<bool>,
    group_idx: Option<i64>,
}

impl Fields {
    fn into_event<E: de::Error>(self, tag: &str) -> Result<KvEvent, E> {
        Ok(match tag {
            "BlockStored" => KvEvent::BlockStored(BlockStored {
                block_hashes: self
                    .block_hashes
                    .ok_or_else(|| E::missing_field("block_hashes"))?,
                parent_block_hash: self.parent_block_hash,
                token_ids: self
                    .token_ids
                    .ok_or_else(|| E::missing_field("token_ids"))?,
                block_size: self
                    .block_size
                    .ok_or_else(|| E::missing_field("block_size"))?,
                medium: self.medium,
                lora_name: self.lora_name,
                extra_keys: self.extra_keys,
                group_idx: self.group_idx,
            }),
            "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: self
                    .block_hashes
                    .ok_or_else(|| E::missing_field("block_hashes"))?,
                medium: self.medium,
                group_idx: self.group_idx,
            }),
            "AllBlocksCleared" => KvEvent::AllBlocksCleared,
            other => KvEvent::Other(other.to_owned()),
        })
    }
}

impl<'de> Deserialize<'de> for KvEvent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EventVisitor;
        impl<'de> Visitor<'de> for EventVisitor {
            type Value = KvEvent;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a KV cache event (tagged array or tagged map)")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<KvEvent, A::Error> {
                let tag: String = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::missing_field("tag"))?;
                let mut fields = Fields::default();
                match tag.as_str() {
                    "BlockStored" => {
                        fields.block_hashes = seq.next_element()?;
                        fields.parent_block_hash = seq.next_element()?.flatten();
                        fields.token_ids = seq.next_element()?;
                        fields.block_size = seq.next_element()?;
                        let _lora_id = seq.next_element::<IgnoredAny>()?;
                        fields.medium = seq.next_element()?.flatten();
                        fields.lora_name = seq.next_element()?.flatten();
                        fields.extra_keys = extra_flags(seq.next_element()?.flatten());
                        fields.group_idx = seq.next_element()?.flatten();
                    }
                    "BlockRemoved" => {
                        fields.block_hashes = seq.next_element()?;
                        fields.medium = seq.next_element()?.flatten();
                        fields.group_idx = seq.next_element()?.flatten();
                    }
                    _ => {}
                }
                drain(&mut seq)?;
                fields.into_event(&tag)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KvEvent, A::Error> {
                let mut tag: Option<String> = None;
                let mut fields = Fields::default();
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "type" => tag = Some(map.next_value()?),
                        "block_hashes" => fields.block_hashes = Some(map.next_value()?),
                        "parent_block_hash" => fields.parent_block_hash = map.next_value()?,
                        "token_ids" => fields.token_ids = Some(map.next_value()?),
                        "block_size" => fields.block_size = Some(map.next_value()?),
                        "medium" => fields.medium = map.next_value()?,
                        "lora_name" => fields.lora_name = map.next_value()?,
                        "extra_keys" => fields.extra_keys = extra_flags(map.next_value()?),
                        "group_idx" => fields.group_idx = map.next_value()?,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                let tag = tag.ok_or_else(|| de::Error::missing_field("type"))?;
                fields.into_event(&tag)
            }
        }
        deserializer.deserialize_any(EventVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes msgpack by hand (the layouts vLLM's msgspec produces).
    struct Pack(Vec<u8>);
    impl Pack {
        fn array(&mut self, len: u32) -> &mut Self {
            rmp::encode::write_array_len(&mut self.0, len).unwrap();
            self
        }
        fn map(&mut self, len: u32) -> &mut Self {
            rmp::encode::write_map_len(&mut self.0, len).unwrap();
            self
        }
        fn str(&mut self, text: &str) -> &mut Self {
            rmp::encode::write_str(&mut self.0, text).unwrap();
            self
        }
        fn uint(&mut self, value: u64) -> &mut Self {
            rmp::encode::write_uint(&mut self.0, value).unwrap();
            self
        }
        fn int(&mut self, value: i64) -> &mut Self {
            rmp::encode::write_sint(&mut self.0, value).unwrap();
            self
        }
        fn bin(&mut self, bytes: &[u8]) -> &mut Self {
            rmp::encode::write_bin(&mut self.0, bytes).unwrap();
            self
        }
        fn nil(&mut self) -> &mut Self {
            rmp::encode::write_nil(&mut self.0).unwrap();
            self
        }
        fn float(&mut self, value: f64) -> &mut Self {
            rmp::encode::write_f64(&mut self.0, value).unwrap();
            self
        }
    }

    #[test]
    fn legacy_positional_events_with_omitted_and_extra_trailing_fields() {
        let mut p = Pack(Vec::new());
        p.array(2).float(1.5).array(4);
        // BlockStored with only the five fields of the first layout (medium omitted).
        p.array(6).str("BlockStored");
        p.array(2)
            .uint(11)
            .int(-12)
            .nil()
            .array(4)
            .uint(1)
            .uint(2)
            .uint(3)
            .uint(4);
        p.uint(2).nil();
        // BlockRemoved with a field from the future.
        p.array(4)
            .str("BlockRemoved")
            .array(1)
            .uint(11)
            .str("GPU")
            .uint(0);
        p.array(1).str("AllBlocksCleared");
        p.array(2).str("Rebalanced").uint(3);
        let batch = decode_batch(&p.0).unwrap();
        assert_eq!(batch.ts, 1.5);
        assert_eq!(batch.data_parallel_rank, None);
        let KvEvent::BlockStored(stored) = &batch.events[0] else {
            panic!("{batch:?}");
        };
        assert_eq!(
            stored.block_hashes,
            [EngineHash(11), EngineHash((-12i64) as u64)]
        );
        assert_eq!(stored.parent_block_hash, None);
        assert_eq!(stored.token_ids, [1, 2, 3, 4]);
        assert_eq!(stored.block_size, 2);
        assert_eq!(stored.medium, None);
        assert_eq!(
            batch.events[1],
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash(11)],
                medium: Some("GPU".into()),
                group_idx: Some(0),
            })
        );
        assert_eq!(batch.events[2], KvEvent::AllBlocksCleared);
        assert_eq!(batch.events[3], KvEvent::Other("Rebalanced".into()));
    }

    #[test]
    fn map_events_with_bytes_hashes_extra_keys_and_unknown_fields() {
        let mut p = Pack(Vec::new());
        p.array(3).float(2.0).array(1);
        p.map(9).str("type").str("BlockStored");
        p.str("block_hashes").array(1).bin(&[1, 2, 3]);
        p.str("parent_block_hash").bin(&[9]);
        p.str("token_ids").array(2).uint(5).uint(6);
        p.str("block_size").uint(2);
        p.str("medium").str("GPU");
        p.str("extra_keys").array(1).array(1).str("salt");
        p.str("kv_cache_spec_kind").str("full_attention");
        p.str("cache_salt").str("tenant");
        p.uint(0);
        let batch = decode_batch(&p.0).unwrap();
        assert_eq!(batch.data_parallel_rank, Some(0));
        let KvEvent::BlockStored(stored) = &batch.events[0] else {
            panic!("{batch:?}");
        };
        assert_eq!(stored.block_hashes.len(), 1);
        assert_ne!(stored.block_hashes[0], EngineHash(0));
        assert!(stored.parent_block_hash.is_some());
        assert_eq!(stored.extra_keys, [true]);
        assert_eq!(stored.lora_name, None);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(decode_batch(b"").is_err());
        assert!(decode_batch(&[0x92, 0xc0]).is_err());
        let mut p = Pack(Vec::new());
        p.array(2)
            .float(1.0)
            .array(1)
            .map(1)
            .str("block_hashes")
            .array(0);
        assert!(decode_batch(&p.0).is_err(), "an event without a type");
    }
}
