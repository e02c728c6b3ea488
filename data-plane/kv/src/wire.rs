//! KV-cache event payloads, decoded from msgpack: vLLM's `KVEventBatch`
//! (`vllm/distributed/kv_events.py`, read at vLLM 0.32.0) and SGLang's
//! (`sglang/srt/disaggregation/kv_events.py`, every generation below). docs/kv-events.md
//! lists the engines and versions and what each field does to the index.
//!
//! A batch is msgspec `array_like`: `[ts, events, data_parallel_rank?]` (SGLang names the third
//! `attn_dp_rank`; a map with those keys is accepted too). Each event is msgspec `tag=True`, in
//! one of two layouts, both accepted so one router fronts a fleet mid-upgrade:
//!
//! - a positional array whose first element is the tag (vLLM up to 0.23, SGLang before it
//!   switched to maps): `["BlockStored", block_hashes, parent_block_hash, token_ids,
//!   block_size, lora_id, medium, X, extra_keys, group_idx, kv_cache_spec_kind, …]`, where `X`
//!   is vLLM's `lora_name` (a string) or SGLang's `BlockStoredWithMetadata.metadata` (a map
//!   `{"cache_salt": …}`); `["BlockRemoved", block_hashes, medium, group_idx]`,
//!   `["AllBlocksCleared"]`;
//! - a map with the tag under `"type"` and the fields by name (vLLM 0.24 and later, SGLang
//!   since its switch; SGLang's map carries `cache_salt` by name).
//!
//! `omit_defaults` means trailing fields at their default may be missing; fields this router
//! does not know (added by later versions) are skipped; block hashes are integers or bytes
//! depending on the engine's hash function; a token id is an integer or, in SGLang's EAGLE
//! bigram pages, a pair whose first element is the token. An unknown event tag is kept as
//! [`KvEvent::Other`]; an event that cannot be read as any of these, in a batch that is
//! otherwise well formed, is kept as [`KvEvent::Malformed`] (it costs that event, not the
//! batch); both are ignored by the index.

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

/// One token id: an integer, or SGLang's bigram pair `[token, next token]` (EAGLE), whose
/// first element is the token at that position.
struct Token(u32);

impl<'de> Deserialize<'de> for Token {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct TokenVisitor;
        impl<'de> Visitor<'de> for TokenVisitor {
            type Value = Token;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id (an integer or a bigram pair)")
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<Token, E> {
                u32::try_from(value)
                    .map(Token)
                    .map_err(|_| E::custom("token_ids: a token id above u32"))
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<Token, E> {
                u32::try_from(value)
                    .map(Token)
                    .map_err(|_| E::custom("token_ids: a negative token id"))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Token, A::Error> {
                let first: u32 = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::custom("token_ids: an empty bigram"))?;
                drain(&mut seq)?;
                Ok(Token(first))
            }
        }
        deserializer.deserialize_any(TokenVisitor)
    }
}

fn token_ids<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u32>, D::Error> {
    let tokens: Vec<Token> = Vec::deserialize(deserializer)?;
    Ok(tokens.into_iter().map(|token| token.0).collect())
}

/// Blocks that entered an engine's prefix cache (or, under vLLM's `kv_cache_report_mode`
/// "full", were reused from it): `block_hashes[i]` holds
/// `token_ids[i * block_size..(i + 1) * block_size]`, chained after `parent_block_hash`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<EngineHash>,
    pub parent_block_hash: Option<EngineHash>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// Per block: what the engine mixed into its hash besides the tokens (vLLM publishes, in
    /// order, the LoRA name, multimodal `(identifier, offset)` pairs, the `cache_salt` on the
    /// first block, prompt-embedding digests). Empty when absent.
    pub extra_keys: Vec<ExtraKeys>,
    pub group_idx: Option<i64>,
    /// vLLM's label of the KV-cache group (`full_attention`, `sliding_window`, `mamba`, …).
    pub kv_cache_spec_kind: Option<String>,
    /// `LOCAL` or `REMOTE` relative to the publisher (vLLM's offloading tiers).
    pub locality: Option<String>,
    /// SGLang's salt (its `metadata.cache_salt`, or `cache_salt` in its map layout).
    pub cache_salt: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<EngineHash>,
    pub medium: Option<String>,
    pub group_idx: Option<i64>,
    pub locality: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    /// The engine emptied a cache (vLLM's `reset_prefix_cache`: its GPU prefix cache).
    /// `medium` when a publisher names the tier it cleared.
    AllBlocksCleared {
        medium: Option<String>,
    },
    /// An event type this router does not know (its tag).
    Other(String),
    /// An event that could not be read (why), in a batch that could.
    Malformed(String),
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
pub enum DecodeError {
    #[error("unreadable KV event batch: {0}")]
    Batch(#[from] rmp_serde::decode::Error),
    #[error("unreadable KV event batch: {0}")]
    Framing(&'static str),
}

/// Decodes one `KVEventBatch` payload. In the positional batch layout each event is read on
/// its own, so an event that cannot be read becomes [`KvEvent::Malformed`] and the others
/// still count; an error is returned only when the batch itself cannot be read.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    match frame::positional_batch(payload) {
        Some(parts) => {
            let parts = parts.map_err(DecodeError::Framing)?;
            let ts: f64 = rmp_serde::from_slice(parts.ts)?;
            let events = parts
                .events
                .into_iter()
                .map(|span| {
                    rmp_serde::from_slice::<KvEvent>(span)
                        .unwrap_or_else(|err| KvEvent::Malformed(err.to_string()))
                })
                .collect();
            let data_parallel_rank = match parts.rank {
                Some(span) => rmp_serde::from_slice::<Option<i64>>(span)?,
                None => None,
            };
            Ok(EventBatch {
                ts,
                events,
                data_parallel_rank,
            })
        }
        None => Ok(rmp_serde::from_slice(payload)?),
    }
}

/// Byte spans of a positional batch, found by walking msgpack's framing (no decoding).
mod frame {
    pub struct Parts<'a> {
        pub ts: &'a [u8],
        pub events: Vec<&'a [u8]>,
        pub rank: Option<&'a [u8]>,
    }

    /// None when the payload is not an array (a map batch: decoded whole); an error when its
    /// framing is broken.
    pub fn positional_batch(payload: &[u8]) -> Option<Result<Parts<'_>, &'static str>> {
        let first = *payload.first()?;
        if !(first & 0xf0 == 0x90 || first == 0xdc || first == 0xdd) {
            return None;
        }
        Some(read_parts(payload))
    }

    fn read_parts(payload: &[u8]) -> Result<Parts<'_>, &'static str> {
        let mut reader = Reader {
            bytes: payload,
            at: 0,
        };
        let fields = reader.array_len()?;
        if fields < 2 {
            return Err("a batch needs ts and events");
        }
        let ts = reader.value_span()?;
        let count = reader.array_len()?;
        // Every event takes at least one byte: a count beyond the payload is a lie.
        if count > payload.len() {
            return Err("an event count beyond the payload");
        }
        let mut events = Vec::with_capacity(count);
        for _ in 0..count {
            events.push(reader.value_span()?);
        }
        let rank = if fields >= 3 {
            Some(reader.value_span()?)
        } else {
            None
        };
        for _ in 3..fields {
            reader.value_span()?;
        }
        Ok(Parts { ts, events, rank })
    }

    struct Reader<'a> {
        bytes: &'a [u8],
        at: usize,
    }

    const TRUNCATED: &str = "truncated msgpack";

    impl<'a> Reader<'a> {
        fn byte(&mut self) -> Result<u8, &'static str> {
            let byte = *self.bytes.get(self.at).ok_or(TRUNCATED)?;
            self.at += 1;
            Ok(byte)
        }

        fn uint(&mut self, width: usize) -> Result<usize, &'static str> {
            let mut value = 0usize;
            for _ in 0..width {
                value = (value << 8) | usize::from(self.byte()?);
            }
            Ok(value)
        }

        fn skip(&mut self, len: usize) -> Result<(), &'static str> {
            let end = self.at.checked_add(len).ok_or(TRUNCATED)?;
            if end > self.bytes.len() {
                return Err(TRUNCATED);
            }
            self.at = end;
            Ok(())
        }

        fn array_len(&mut self) -> Result<usize, &'static str> {
            match self.byte()? {
                marker @ 0x90..=0x9f => Ok(usize::from(marker & 0x0f)),
                0xdc => self.uint(2),
                0xdd => self.uint(4),
                _ => Err("an array was expected"),
            }
        }

        /// The span of the next whole value.
        fn value_span(&mut self) -> Result<&'a [u8], &'static str> {
            let start = self.at;
            // Values still to skip; nested containers add their elements.
            let mut pending = 1usize;
            while pending > 0 {
                pending -= 1;
                let marker = self.byte()?;
                let children = match marker {
                    0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => 0,
                    0x80..=0x8f => 2 * usize::from(marker & 0x0f),
                    0x90..=0x9f => usize::from(marker & 0x0f),
                    0xa0..=0xbf => {
                        self.skip(usize::from(marker & 0x1f))?;
                        0
                    }
                    0xcc | 0xd0 => self.skip(1).map(|()| 0)?,
                    0xcd | 0xd1 => self.skip(2).map(|()| 0)?,
                    0xce | 0xd2 | 0xca => self.skip(4).map(|()| 0)?,
                    0xcf | 0xd3 | 0xcb => self.skip(8).map(|()| 0)?,
                    0xc4 | 0xd9 => {
                        let len = self.uint(1)?;
                        self.skip(len).map(|()| 0)?
                    }
                    0xc5 | 0xda => {
                        let len = self.uint(2)?;
                        self.skip(len).map(|()| 0)?
                    }
                    0xc6 | 0xdb => {
                        let len = self.uint(4)?;
                        self.skip(len).map(|()| 0)?
                    }
                    0xd4 => self.skip(2).map(|()| 0)?,
                    0xd5 => self.skip(3).map(|()| 0)?,
                    0xd6 => self.skip(5).map(|()| 0)?,
                    0xd7 => self.skip(9).map(|()| 0)?,
                    0xd8 => self.skip(17).map(|()| 0)?,
                    0xc7 => {
                        let len = self.uint(1)?;
                        self.skip(len + 1).map(|()| 0)?
                    }
                    0xc8 => {
                        let len = self.uint(2)?;
                        self.skip(len + 1).map(|()| 0)?
                    }
                    0xc9 => {
                        let len = self.uint(4)?;
                        self.skip(len + 1).map(|()| 0)?
                    }
                    0xdc => self.uint(2)?,
                    0xdd => self.uint(4)?,
                    0xde => 2 * self.uint(2)?,
                    0xdf => 2 * self.uint(4)?,
                    0xc1 => return Err("the reserved msgpack marker 0xc1"),
                };
                // Each child takes at least one byte.
                if children > self.bytes.len() - self.at {
                    return Err(TRUNCATED);
                }
                pending += children;
            }
            Ok(&self.bytes[start..self.at])
        }
    }
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
                        "data_parallel_rank" | "attn_dp_rank" => rank = map.next_value()?,
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

/// One block's `extra_keys` entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ExtraKeys {
    /// None: the tokens alone.
    #[default]
    None,
    /// Only strings (LoRA names, a cache salt), in order.
    Strings(Vec<String>),
    /// Something else too (multimodal inputs, prompt embeddings): no request's text reaches it.
    Opaque,
}

impl<'de> Deserialize<'de> for ExtraKeys {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeysVisitor;
        impl<'de> Visitor<'de> for KeysVisitor {
            type Value = ExtraKeys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a block's extra keys (nil or a tuple)")
            }
            fn visit_unit<E: de::Error>(self) -> Result<ExtraKeys, E> {
                Ok(ExtraKeys::None)
            }
            fn visit_none<E: de::Error>(self) -> Result<ExtraKeys, E> {
                Ok(ExtraKeys::None)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ExtraKeys, A::Error> {
                let mut strings = Vec::new();
                let mut opaque = false;
                while let Some(key) = seq.next_element::<Key>()? {
                    match key {
                        Key::Str(text) => strings.push(text),
                        Key::Other => opaque = true,
                    }
                }
                Ok(if opaque {
                    ExtraKeys::Opaque
                } else if strings.is_empty() {
                    ExtraKeys::None
                } else {
                    ExtraKeys::Strings(strings)
                })
            }
        }
        deserializer.deserialize_any(KeysVisitor)
    }
}

/// One element of an `extra_keys` tuple: a string, or anything else (skipped).
enum Key {
    Str(String),
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an extra key")
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<Key, E> {
                Ok(Key::Str(value.to_owned()))
            }
            fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<Key, E> {
                Ok(Key::Other)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Key, E> {
                Ok(Key::Other)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Key, E> {
                Ok(Key::Other)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Key, E> {
                Ok(Key::Other)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Key, E> {
                Ok(Key::Other)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Key, E> {
                Ok(Key::Other)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Key, A::Error> {
                drain(&mut seq)?;
                Ok(Key::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Key, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Key::Other)
            }
        }
        deserializer.deserialize_any(KeyVisitor)
    }
}

/// `extra_keys`: per block, nil or a tuple.
fn extra_keys(extra: Option<Vec<ExtraKeys>>) -> Vec<ExtraKeys> {
    extra.unwrap_or_default()
}

/// What may follow `medium` in the positional layout: vLLM's `lora_name` or SGLang's
/// `metadata` map.
#[derive(Default)]
struct AfterMedium {
    lora_name: Option<String>,
    cache_salt: Option<String>,
}

impl<'de> Deserialize<'de> for AfterMedium {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct AfterMediumVisitor;
        impl<'de> Visitor<'de> for AfterMediumVisitor {
            type Value = AfterMedium;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("lora_name (a string or nil) or metadata (a map)")
            }
            fn visit_unit<E: de::Error>(self) -> Result<AfterMedium, E> {
                Ok(AfterMedium::default())
            }
            fn visit_none<E: de::Error>(self) -> Result<AfterMedium, E> {
                Ok(AfterMedium::default())
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<AfterMedium, E> {
                Ok(AfterMedium {
                    lora_name: Some(value.to_owned()),
                    cache_salt: None,
                })
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<AfterMedium, A::Error> {
                Ok(AfterMedium {
                    lora_name: None,
                    cache_salt: metadata_salt(map)?,
                })
            }
        }
        deserializer.deserialize_any(AfterMediumVisitor)
    }
}

/// `cache_salt` of SGLang's `BlockStoredMetadata` map (other keys skipped).
fn metadata_salt<'de, A: MapAccess<'de>>(mut map: A) -> Result<Option<String>, A::Error> {
    let mut salt = None;
    while let Some(key) = map.next_key::<String>()? {
        if key == "cache_salt" {
            salt = map.next_value()?;
        } else {
            map.next_value::<IgnoredAny>()?;
        }
    }
    Ok(salt)
}

/// SGLang's `metadata` under its own key (map layout).
struct Metadata(Option<String>);

impl<'de> Deserialize<'de> for Metadata {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        AfterMedium::deserialize(deserializer).map(|after| Metadata(after.cache_salt))
    }
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
    extra_keys: Vec<ExtraKeys>,
    group_idx: Option<i64>,
    kv_cache_spec_kind: Option<String>,
    locality: Option<String>,
    cache_salt: Option<String>,
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
                kv_cache_spec_kind: self.kv_cache_spec_kind,
                locality: self.locality,
                cache_salt: self.cache_salt,
            }),
            "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: self
                    .block_hashes
                    .ok_or_else(|| E::missing_field("block_hashes"))?,
                medium: self.medium,
                group_idx: self.group_idx,
                locality: self.locality,
            }),
            "AllBlocksCleared" => KvEvent::AllBlocksCleared {
                medium: self.medium,
            },
            other => KvEvent::Other(other.to_owned()),
        })
    }
}

/// A `token_ids` element of the positional layout.
struct Tokens(Vec<u32>);

impl<'de> Deserialize<'de> for Tokens {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        token_ids(deserializer).map(Tokens)
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
                        fields.token_ids = seq.next_element::<Tokens>()?.map(|tokens| tokens.0);
                        fields.block_size = seq.next_element()?;
                        let _lora_id = seq.next_element::<IgnoredAny>()?;
                        fields.medium = seq.next_element()?.flatten();
                        let after = seq.next_element::<AfterMedium>()?.unwrap_or_default();
                        fields.lora_name = after.lora_name;
                        fields.cache_salt = after.cache_salt;
                        fields.extra_keys = extra_keys(seq.next_element()?.flatten());
                        fields.group_idx = seq.next_element()?.flatten();
                        fields.kv_cache_spec_kind = seq.next_element()?.flatten();
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
                        "token_ids" => {
                            fields.token_ids = Some(map.next_value::<Tokens>()?.0);
                        }
                        "block_size" => fields.block_size = Some(map.next_value()?),
                        "medium" => fields.medium = map.next_value()?,
                        "lora_name" => fields.lora_name = map.next_value()?,
                        "extra_keys" => fields.extra_keys = extra_keys(map.next_value()?),
                        "group_idx" => fields.group_idx = map.next_value()?,
                        "kv_cache_spec_kind" => fields.kv_cache_spec_kind = map.next_value()?,
                        "locality" => fields.locality = map.next_value()?,
                        "cache_salt" => fields.cache_salt = map.next_value()?,
                        "metadata" => {
                            if let Some(salt) = map.next_value::<Metadata>()?.0 {
                                fields.cache_salt = Some(salt);
                            }
                        }
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
                locality: None,
            })
        );
        assert_eq!(batch.events[2], KvEvent::AllBlocksCleared { medium: None });
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
        assert_eq!(stored.extra_keys, [ExtraKeys::Strings(vec!["salt".into()])]);
        assert_eq!(stored.lora_name, None);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic_and_one_bad_event_costs_that_event() {
        assert!(decode_batch(b"").is_err());
        assert!(decode_batch(&[0x92, 0xc0]).is_err());
        assert!(decode_batch(&[0x92, 0xcb, 0, 0]).is_err(), "truncated");
        assert!(
            decode_batch(&[
                0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff
            ])
            .is_err(),
            "a count beyond the payload"
        );
        let mut p = Pack(Vec::new());
        p.array(2).float(1.0).array(3);
        p.map(1).str("block_hashes").array(0);
        p.map(2)
            .str("type")
            .str("BlockStored")
            .str("token_ids")
            .str("x");
        p.map(2)
            .str("type")
            .str("BlockRemoved")
            .str("block_hashes")
            .array(1)
            .uint(4);
        let batch = decode_batch(&p.0).unwrap();
        assert!(matches!(&batch.events[0], KvEvent::Malformed(why) if why.contains("type")));
        assert!(matches!(&batch.events[1], KvEvent::Malformed(_)));
        assert_eq!(
            batch.events[2],
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash(4)],
                ..BlockRemoved::default()
            })
        );
    }

    /// SGLang's positional BlockStored: `[tag, hashes, parent, tokens, block_size, lora_id,
    /// medium?, metadata?]`.
    fn sglang_array(p: &mut Pack, tokens: impl Fn(&mut Pack), medium: bool, salt: Option<&str>) {
        let len = 6 + u32::from(medium) + u32::from(salt.is_some());
        p.array(len).str("BlockStored").array(1).int(-5).nil();
        tokens(p);
        p.uint(2).nil();
        if medium {
            p.str("GPU");
        }
        if let Some(salt) = salt {
            p.map(1).str("cache_salt").str(salt);
        }
    }

    #[test]
    fn every_sglang_generation_decodes() {
        let plain = |p: &mut Pack| {
            p.array(2).uint(7).uint(8);
        };
        let bigram = |p: &mut Pack| {
            p.array(2).array(2).uint(7).uint(8).array(2).uint(8).uint(9);
        };
        for (medium, salt, bigrams) in [
            (false, None, false),
            (true, None, false),
            (true, Some("tenant"), false),
            (true, None, true),
        ] {
            let mut p = Pack(Vec::new());
            p.array(3).float(1.0).array(2);
            if bigrams {
                sglang_array(&mut p, bigram, medium, salt);
            } else {
                sglang_array(&mut p, plain, medium, salt);
            }
            p.array(2).str("BlockRemoved").array(1).int(-5);
            p.uint(1);
            let batch = decode_batch(&p.0).unwrap();
            assert_eq!(batch.data_parallel_rank, Some(1));
            let KvEvent::BlockStored(stored) = &batch.events[0] else {
                panic!("{batch:?}");
            };
            assert_eq!(stored.token_ids, [7, 8], "bigrams {bigrams}");
            assert_eq!(stored.cache_salt.as_deref(), salt);
            assert_eq!(stored.lora_name, None);
            assert_eq!(stored.medium.is_some(), medium);
            assert!(matches!(batch.events[1], KvEvent::BlockRemoved(_)));
        }
        // The map generation: cache_salt and session_id by name.
        let mut p = Pack(Vec::new());
        p.array(3).float(1.0).array(1);
        p.map(9).str("type").str("BlockStored");
        p.str("block_hashes").array(1).uint(3);
        p.str("parent_block_hash").nil();
        p.str("token_ids").array(1).array(2).uint(1).uint(2);
        p.str("block_size").uint(1);
        p.str("lora_id").nil();
        p.str("medium").str("CPU_PINNED");
        p.str("cache_salt").str("s");
        p.str("session_id").str("x");
        p.nil();
        let batch = decode_batch(&p.0).unwrap();
        let KvEvent::BlockStored(stored) = &batch.events[0] else {
            panic!("{batch:?}");
        };
        assert_eq!(stored.token_ids, [1]);
        assert_eq!(stored.cache_salt.as_deref(), Some("s"));
        assert_eq!(stored.medium.as_deref(), Some("CPU_PINNED"));
    }

    #[test]
    fn vllm_0_32_fields_a_router_reads() {
        let mut p = Pack(Vec::new());
        p.array(3).float(1.0).array(3);
        p.map(8).str("type").str("BlockStored");
        p.str("block_hashes").array(1).uint(3);
        p.str("parent_block_hash").nil();
        p.str("token_ids").array(1).uint(1);
        p.str("block_size").uint(1);
        p.str("group_idx").uint(1);
        p.str("kv_cache_spec_kind").str("sliding_window");
        p.str("locality").str("REMOTE");
        p.map(3).str("type").str("BlockRemoved");
        p.str("block_hashes").array(1).uint(3);
        p.str("locality").str("LOCAL");
        p.map(2)
            .str("type")
            .str("AllBlocksCleared")
            .str("medium")
            .str("CPU");
        p.uint(0);
        let batch = decode_batch(&p.0).unwrap();
        let KvEvent::BlockStored(stored) = &batch.events[0] else {
            panic!("{batch:?}");
        };
        assert_eq!(stored.group_idx, Some(1));
        assert_eq!(stored.kv_cache_spec_kind.as_deref(), Some("sliding_window"));
        assert_eq!(stored.locality.as_deref(), Some("REMOTE"));
        let KvEvent::BlockRemoved(removed) = &batch.events[1] else {
            panic!("{batch:?}");
        };
        assert_eq!(removed.locality.as_deref(), Some("LOCAL"));
        assert_eq!(
            batch.events[2],
            KvEvent::AllBlocksCleared {
                medium: Some("CPU".into())
            }
        );
    }
}
