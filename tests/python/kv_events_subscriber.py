"""Reads a KV-cache event publisher the way vLLM's own subscribers do: pyzmq (libzmq) sockets
and msgspec decoders typed with vLLM's event structures.

Usage: python kv_events_subscriber.py PUB_ENDPOINT REPLAY_ENDPOINT array|map

1. Subscribes to PUB_ENDPOINT (every topic) and asks REPLAY_ENDPOINT for every buffered batch
   from sequence 0 (a DEALER sends ["", seq as 8 bytes big-endian]; the ROUTER answers
   ["", topic, seq, payload] per batch and ["", "", -1, ""] at the end, as vLLM 0.32 does;
   earlier vLLM and SGLang leave the topic frame out).
2. Prints "ready" and waits (at most 10 s) for one live message on the subscription.
3. Prints one JSON line: {"replayed": [batch, ...], "live": {"seq": N, "topic": T, "batch": B}},
   each batch decoded with the structures below, then re-encoded to JSON.

The structures are vLLM's (vllm/distributed/kv_events.py): "array" is the layout up to vLLM
0.23 and of its example subscriber (examples/online_serving/kv_events_subscriber.py): batch and
events msgspec `array_like=True, tag=True, omit_defaults=True`; "map" is current vLLM's, where
events dropped `array_like` (tagged maps) and the batch stayed positional.
"""

import json
import sys
from typing import Any, Optional, Union

import msgspec
import zmq


class LegacyEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class LegacyKVCacheEvent(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True
):
    pass


class LegacyBlockStored(LegacyKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class LegacyBlockRemoved(LegacyKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str]


class LegacyAllBlocksCleared(LegacyKVCacheEvent, tag="AllBlocksCleared"):
    pass


class LegacyKVEventBatch(LegacyEventBatch):
    events: list[Union[LegacyBlockStored, LegacyBlockRemoved, LegacyAllBlocksCleared]]


ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def to_json(batch: Any) -> dict:
    events = []
    for event in batch.events:
        fields = {name: getattr(event, name) for name in event.__struct_fields__}
        fields["type"] = type(event).__name__.removeprefix("Legacy")
        events.append(fields)
    rank = getattr(batch, "data_parallel_rank", None)
    return {"ts": batch.ts, "events": events, "data_parallel_rank": rank}


def main() -> None:
    pub_endpoint, replay_endpoint, layout = sys.argv[1], sys.argv[2], sys.argv[3]
    decoder = msgspec.msgpack.Decoder(
        type=LegacyKVEventBatch if layout == "array" else KVEventBatch
    )
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(pub_endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")

    replay = context.socket(zmq.DEALER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.connect(replay_endpoint)
    replay.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed = []
    while True:
        if not replay.poll(10_000):
            raise SystemExit("no answer from the replay socket within 10 s")
        # vLLM 0.32: ["", topic, seq, payload]; earlier vLLM and SGLang: ["", seq, payload].
        frames = replay.recv_multipart()
        assert len(frames) in (3, 4), frames
        seq_bytes, payload = frames[-2], frames[-1]
        if seq_bytes == END_OF_REPLAY:
            assert payload == b"", payload
            break
        seq = int.from_bytes(seq_bytes, "big")
        replayed.append({"seq": seq, "batch": to_json(decoder.decode(payload))})

    print("ready", flush=True)
    if not sub.poll(10_000):
        raise SystemExit("no live message within 10 s")
    topic, seq_bytes, payload = sub.recv_multipart()
    live = {
        "seq": int.from_bytes(seq_bytes, "big"),
        "topic": topic.decode(),
        "batch": to_json(decoder.decode(payload)),
    }
    print(json.dumps({"replayed": replayed, "live": live}, default=repr), flush=True)
    sub.close()
    replay.close()
    context.term()


if __name__ == "__main__":
    main()
