//! vLLM's KV-cache event publisher (`--kv-events-config` with the `zmq` publisher), on the
//! simulator's real prefix cache.
//!
//! Wire format, as vLLM's `vllm/distributed/kv_events.py` (`ZmqEventPublisher`) sends it:
//!
//! - **PUB socket**: one multipart message per batch: `topic`, the sequence number as 8 bytes
//!   big-endian (0, 1, 2, … from start), and the msgpack payload.
//! - **Payload**: a `KVEventBatch`, msgspec `array_like`: `[ts, events, data_parallel_rank]`
//!   (`ts` a float of Unix seconds; rank 0). Each event is msgspec `tag=True`: with
//!   `--kv-events-format array` (vLLM up to 0.23, the layout of vLLM's example subscriber) a
//!   positional array whose first element is the class name: `["BlockStored", block_hashes,
//!   parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`,
//!   `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`; with `map` (vLLM after
//!   it dropped `array_like` from events) a map with the class name under `"type"` and the
//!   fields by name (plus `extra_keys`, `group_idx`, `kv_cache_spec_kind` as current vLLM
//!   sends them). Block hashes are the simulator's own (unsigned 64-bit integers); `medium` is
//!   `"GPU"`; LoRA fields are nil.
//! - **ROUTER replay socket**: a request `[identity, "", start_seq (8 bytes big-endian)]` is
//!   answered with `[identity, "", topic, seq, payload]` for every buffered batch with `seq >=
//!   start_seq` (the last `--kv-events-replay-buffer` batches), then the end marker
//!   `[identity, "", "", -1 as 8 bytes big-endian, ""]`, as vLLM 0.32 sends them (earlier vLLM
//!   and SGLang leave the topic out; a subscriber reads the last two frames).
//!
//! Test controls (`POST /sim/kv-events`): `drop_next` publishes the next N batches to the
//! replay buffer only (a gap on the wire, repairable by replay); `stalled` stops publishing and
//! answering replay, like a stuck publisher thread (batches queue up and go out in order once
//! it resumes).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::Bytes;
use serde::Serialize;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::cache::CacheEvent;
use crate::metrics::Metrics;

/// Batches the engine may queue for the publisher before new ones are lost (vLLM's
/// `max_queue_size`).
pub(crate) const QUEUE_BATCHES: usize = 100_000;
/// The replay stream's end marker: -1 as a signed 8-byte big-endian integer.
const END_OF_REPLAY: [u8; 8] = [0xff; 8];

/// How events are laid out in msgpack (the batch is a positional array either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KvEventsFormat {
    /// Each event a tagged positional array (vLLM up to 0.23; its example subscriber).
    #[default]
    Array,
    /// Each event a tagged map (current vLLM).
    Map,
}

/// What `GET /sim/kv-events` reports.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct KvEventsInfo {
    /// The PUB endpoint as bound (a requested port 0 resolved): `tcp://127.0.0.1:PORT`.
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub format: KvEventsFormat,
    pub replay_buffer: usize,
}

/// Run-time controls and counters shared with the HTTP handlers.
#[derive(Debug, Default)]
pub(crate) struct KvEventsControl {
    stalled: AtomicBool,
    drop_next: AtomicU64,
    next_seq: AtomicU64,
    dropped: AtomicU64,
    changed: Notify,
}

/// The state `GET /sim/kv-events` shows beside [`KvEventsInfo`].
#[derive(Debug, Clone, Serialize)]
pub(crate) struct KvEventsState {
    pub stalled: bool,
    pub drop_next: u64,
    /// The sequence number the next batch gets (= batches published so far).
    pub next_seq: u64,
    /// Batches kept off the wire by `drop_next` so far.
    pub dropped: u64,
}

impl KvEventsControl {
    pub(crate) fn set(&self, stalled: Option<bool>, drop_next: Option<u64>) {
        if let Some(stalled) = stalled {
            self.stalled.store(stalled, Ordering::SeqCst);
        }
        if let Some(drop_next) = drop_next {
            self.drop_next.store(drop_next, Ordering::SeqCst);
        }
        self.changed.notify_one();
    }

    pub(crate) fn state(&self) -> KvEventsState {
        KvEventsState {
            stalled: self.stalled.load(Ordering::SeqCst),
            drop_next: self.drop_next.load(Ordering::SeqCst),
            next_seq: self.next_seq.load(Ordering::SeqCst),
            dropped: self.dropped.load(Ordering::SeqCst),
        }
    }

    /// Takes one batch off the `drop_next` count; true if this batch is to be dropped.
    fn take_drop(&self) -> bool {
        self.drop_next
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                left.checked_sub(1)
            })
            .is_ok()
    }
}

/// A KV-event socket that could not be bound, named by its flag. The zeromq error is part of
/// the message (not a `source`), so that an error chain shows it once.
#[derive(Debug, thiserror::Error)]
#[error("{flag} {endpoint}: cannot bind: {error}")]
pub struct KvEventsBindError {
    pub flag: &'static str,
    pub endpoint: String,
    pub error: zeromq::ZmqError,
}

/// Bound sockets, ready to run.
pub(crate) struct KvEventsPublisher {
    publisher: zeromq::PubSocket,
    replay: Option<zeromq::RouterSocket>,
    info: KvEventsInfo,
}

impl std::fmt::Debug for KvEventsPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvEventsPublisher")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

/// `tcp://*:PORT` binds every interface, as in vLLM's config; zeromq wants an address.
fn bind_address(endpoint: &str) -> String {
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

impl KvEventsPublisher {
    /// Binds the PUB socket (and the ROUTER replay socket, if given).
    pub(crate) async fn bind(
        endpoint: &str,
        replay_endpoint: Option<&str>,
        topic: &str,
        format: KvEventsFormat,
        replay_buffer: usize,
    ) -> Result<Self, KvEventsBindError> {
        let bind_error =
            |flag: &'static str, endpoint: &str, error: zeromq::ZmqError| KvEventsBindError {
                flag,
                endpoint: endpoint.to_owned(),
                error,
            };
        let mut publisher = zeromq::PubSocket::new();
        let bound = publisher
            .bind(&bind_address(endpoint))
            .await
            .map_err(|err| bind_error("--kv-events", endpoint, err))?;
        let (replay, replay_bound) = match replay_endpoint {
            Some(replay_endpoint) => {
                let mut replay = zeromq::RouterSocket::new();
                let bound = replay
                    .bind(&bind_address(replay_endpoint))
                    .await
                    .map_err(|err| bind_error("--kv-events-replay", replay_endpoint, err))?;
                (Some(replay), Some(bound.to_string()))
            }
            None => (None, None),
        };
        Ok(Self {
            publisher,
            replay,
            info: KvEventsInfo {
                endpoint: bound.to_string(),
                replay_endpoint: replay_bound,
                topic: topic.to_owned(),
                format,
                replay_buffer,
            },
        })
    }

    pub(crate) fn info(&self) -> &KvEventsInfo {
        &self.info
    }

    /// Publishes the engine's batches and answers replay requests until `stop`.
    pub(crate) async fn run(
        self,
        mut batches: mpsc::Receiver<Vec<CacheEvent>>,
        control: Arc<KvEventsControl>,
        metrics: Arc<Metrics>,
        stop: CancellationToken,
    ) {
        let Self {
            mut publisher,
            mut replay,
            info,
        } = self;
        let topic = Bytes::from(info.topic.clone().into_bytes());
        let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::new();
        loop {
            let stalled = control.stalled.load(Ordering::SeqCst);
            tokio::select! {
                () = stop.cancelled() => break,
                () = control.changed.notified() => {}
                batch = batches.recv(), if !stalled => {
                    let Some(events) = batch else { break };
                    let seq = control.next_seq.fetch_add(1, Ordering::SeqCst);
                    let payload = Bytes::from(encode_batch(switchyard_process::clock::unix_seconds_f64(), &events, info.format));
                    if control.take_drop() {
                        control.dropped.fetch_add(1, Ordering::SeqCst);
                    } else {
                        let message = frames(vec![
                            topic.clone(),
                            Bytes::copy_from_slice(&seq.to_be_bytes()),
                            payload.clone(),
                        ]);
                        if let Err(err) = publisher.send(message).await {
                            tracing::warn!(error = %err, "cannot publish a KV event batch");
                        }
                    }
                    Metrics::increment(&metrics.kv_event_batches_published);
                    buffer.push_back((seq, payload));
                    while buffer.len() > info.replay_buffer {
                        buffer.pop_front();
                    }
                }
                request = recv_replay(&mut replay), if !stalled => match request {
                    Ok(request) => {
                        if let Some(replay) = &mut replay {
                            answer_replay(replay, request, &topic, &buffer).await;
                        }
                    }
                    Err(err) => tracing::debug!(error = %err, "replay socket receive failed"),
                },
            }
        }
    }
}

async fn recv_replay(replay: &mut Option<zeromq::RouterSocket>) -> zeromq::ZmqResult<ZmqMessage> {
    match replay {
        Some(replay) => replay.recv().await,
        None => std::future::pending().await,
    }
}

fn frames(frames: Vec<Bytes>) -> ZmqMessage {
    // Never empty: every caller passes at least two frames.
    ZmqMessage::try_from(frames).unwrap_or_else(|_| ZmqMessage::from(Bytes::new()))
}

/// Answers `[identity, "", start_seq]` with the buffered batches from `start_seq` on and the
/// end marker, as vLLM's `_service_replay` does.
async fn answer_replay(
    replay: &mut zeromq::RouterSocket,
    request: ZmqMessage,
    topic: &Bytes,
    buffer: &VecDeque<(u64, Bytes)>,
) {
    let parts = request.into_vec();
    let [identity, _delimiter, start] = parts.as_slice() else {
        tracing::warn!(frames = parts.len(), "invalid KV event replay request");
        return;
    };
    let start = start
        .as_ref()
        .try_into()
        .map(u64::from_be_bytes)
        .unwrap_or(u64::MAX);
    for (seq, payload) in buffer.iter().filter(|(seq, _)| *seq >= start) {
        let reply = frames(vec![
            identity.clone(),
            Bytes::new(),
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload.clone(),
        ]);
        if let Err(err) = replay.send(reply).await {
            tracing::debug!(error = %err, "replay client went away");
            return;
        }
    }
    let end = frames(vec![
        identity.clone(),
        Bytes::new(),
        Bytes::new(),
        Bytes::from_static(&END_OF_REPLAY),
        Bytes::new(),
    ]);
    if let Err(err) = replay.send(end).await {
        tracing::debug!(error = %err, "replay client went away");
    }
}

/// Encodes one `KVEventBatch` (see the module documentation for the layout).
pub(crate) fn encode_batch(ts: f64, events: &[CacheEvent], format: KvEventsFormat) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    let mut writer = MsgPack(&mut out);
    writer.array(3);
    writer.float(ts);
    writer.array(events.len());
    for event in events {
        encode_event(&mut writer, event, format);
    }
    writer.uint(0); // data_parallel_rank
    out
}

/// Writes one event: a tagged positional array (its fields in vLLM's order) or a tagged map
/// (the same fields by name, and the ones only current vLLM sends).
fn encode_event(writer: &mut MsgPack<'_>, event: &CacheEvent, format: KvEventsFormat) {
    let named = format == KvEventsFormat::Map;
    let mut fields = EventFields { writer, named };
    match event {
        CacheEvent::Stored {
            parent,
            hashes,
            tokens,
            lora,
        } => {
            fields.start(8, 11);
            fields.field("type").str("BlockStored");
            fields.field("block_hashes").uints(hashes.iter().copied());
            fields.field("parent_block_hash").optional_uint(*parent);
            fields
                .field("token_ids")
                .uints(tokens.iter().map(|token| u64::from(*token)));
            fields.field("block_size").uint(block_size(hashes, tokens));
            fields
                .field("lora_id")
                .optional_uint(lora.as_ref().map(|lora| u64::from(lora.id)));
            fields.field("medium").str("GPU");
            fields
                .field("lora_name")
                .optional_str(lora.as_ref().map(|lora| &*lora.name));
            if named {
                // vLLM 0.32 names a block's adapter first among its extra keys, on every block.
                let writer = fields.field("extra_keys");
                writer.array(hashes.len());
                for _ in hashes {
                    match lora {
                        Some(lora) => {
                            writer.array(1);
                            writer.str(&lora.name);
                        }
                        None => writer.nil(),
                    }
                }
                fields.field("group_idx").uint(0);
                fields.field("kv_cache_spec_kind").str("full_attention");
            }
        }
        CacheEvent::Removed { hashes } => {
            fields.start(3, 4);
            fields.field("type").str("BlockRemoved");
            fields.field("block_hashes").uints(hashes.iter().copied());
            fields.field("medium").str("GPU");
            if named {
                fields.field("group_idx").uint(0);
            }
        }
        CacheEvent::Cleared => {
            fields.start(1, 1);
            fields.field("type").str("AllBlocksCleared");
        }
    }
}

/// An event's fields as they are written: by position, or each after its name.
struct EventFields<'w, 'a> {
    writer: &'w mut MsgPack<'a>,
    named: bool,
}

impl<'a> EventFields<'_, 'a> {
    /// Starts the event: `positional` fields in an array, or `named` ones in a map.
    fn start(&mut self, positional: usize, named: usize) {
        if self.named {
            self.writer.map(named);
        } else {
            self.writer.array(positional);
        }
    }

    /// The writer of the next field's value, its name written first in a map.
    fn field(&mut self, name: &str) -> &mut MsgPack<'a> {
        if self.named {
            self.writer.str(name);
        }
        self.writer
    }
}

fn block_size(hashes: &[u64], tokens: &[u32]) -> u64 {
    (tokens.len() / hashes.len().max(1)) as u64
}

/// A msgpack writer into a `Vec` (writes to a `Vec` cannot fail).
struct MsgPack<'a>(&'a mut Vec<u8>);

impl MsgPack<'_> {
    fn array(&mut self, len: usize) {
        let _ = rmp::encode::write_array_len(self.0, len as u32);
    }
    fn map(&mut self, len: usize) {
        let _ = rmp::encode::write_map_len(self.0, len as u32);
    }
    fn str(&mut self, text: &str) {
        let _ = rmp::encode::write_str(self.0, text);
    }
    fn uint(&mut self, value: u64) {
        let _ = rmp::encode::write_uint(self.0, value);
    }
    fn float(&mut self, value: f64) {
        let _ = rmp::encode::write_f64(self.0, value);
    }
    fn nil(&mut self) {
        let _ = rmp::encode::write_nil(self.0);
    }
    fn optional_uint(&mut self, value: Option<u64>) {
        match value {
            Some(value) => self.uint(value),
            None => self.nil(),
        }
    }
    fn optional_str(&mut self, value: Option<&str>) {
        match value {
            Some(value) => self.str(value),
            None => self.nil(),
        }
    }
    fn uints(&mut self, values: impl ExactSizeIterator<Item = u64>) {
        self.array(values.len());
        for value in values {
            self.uint(value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_layout_matches_vllms_positional_structs() {
        let events = [
            CacheEvent::Stored {
                parent: None,
                hashes: vec![7],
                tokens: vec![1, 2],
                lora: None,
            },
            CacheEvent::Removed { hashes: vec![7] },
            CacheEvent::Cleared,
        ];
        let bytes = encode_batch(1.0, &events, KvEventsFormat::Array);
        let mut expected = vec![0x93, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0x93];
        expected.push(0x98);
        expected.push(0xab);
        expected.extend_from_slice(b"BlockStored");
        expected.extend_from_slice(&[0x91, 7, 0xc0, 0x92, 1, 2, 2, 0xc0, 0xa3]);
        expected.extend_from_slice(b"GPU");
        expected.push(0xc0);
        expected.extend_from_slice(&[0x93, 0xac]);
        expected.extend_from_slice(b"BlockRemoved");
        expected.extend_from_slice(&[0x91, 7, 0xa3]);
        expected.extend_from_slice(b"GPU");
        expected.extend_from_slice(&[0x91, 0xb0]);
        expected.extend_from_slice(b"AllBlocksCleared");
        expected.push(0);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn an_adapters_blocks_carry_its_id_and_name_and_name_every_blocks_extra_keys() {
        let lora = Some(crate::cache::Lora {
            id: 2,
            name: "sql".into(),
        });
        let stored = CacheEvent::Stored {
            parent: None,
            hashes: vec![7, 8],
            tokens: vec![1, 2, 3, 4],
            lora,
        };
        let map = encode_batch(1.0, std::slice::from_ref(&stored), KvEventsFormat::Map);
        let find = |needle: &[u8]| map.windows(needle.len()).position(|w| w == needle);
        // "lora_id": 2 ... "lora_name": "sql" ... "extra_keys": [["sql"], ["sql"]]
        let id = find(b"\xa7lora_id").expect("lora_id");
        assert_eq!(map[id + 8], 2);
        let name = find(b"\xa9lora_name").expect("lora_name");
        assert_eq!(&map[name + 10..name + 14], b"\xa3sql");
        let keys = find(b"\xaaextra_keys").expect("extra_keys");
        assert_eq!(&map[keys + 11..keys + 22], b"\x92\x91\xa3sql\x91\xa3sql");
        let array = encode_batch(1.0, &[stored], KvEventsFormat::Array);
        assert!(array.ends_with(b"\x02\xa3GPU\xa3sql\x00"), "{array:x?}");
    }

    #[test]
    fn drop_next_counts_down() {
        let control = KvEventsControl::default();
        control.set(None, Some(2));
        assert!(control.take_drop());
        assert!(control.take_drop());
        assert!(!control.take_drop());
    }
}
