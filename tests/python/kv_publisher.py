"""Publishes KV-cache events the way vLLM 0.32 or a generation of SGLang does, for tests that
drive a router with them.

Usage: python kv_publisher.py FLAVOR [--data-parallel-size N]

FLAVOR is one of
  vllm-0.32       vLLM 0.32.0 (vllm/distributed/kv_events.py): tagged-map events with
                  omit_defaults, a positional batch [ts, events, data_parallel_rank]; replay
                  answers [topic, seq, payload] after the delimiter.
  sglang-0        SGLang before events named a medium: positional events
                  ["BlockStored", hashes, parent, tokens, block_size, lora_id].
  sglang-medium   SGLang with positional events and a medium; a salted block is its
                  BlockStoredWithMetadata, whose eighth element is {"cache_salt": ...}.
  sglang-map      SGLang since its events became tagged maps (cache_salt, session_id by name).
  sglang-0.5.23   SGLang 0.5.23 (python/sglang/srt/disaggregation/kv_events.py in its wheel):
                  tagged maps with lora_name too, and replay answers with a topic frame, as
                  vLLM's ([topic, seq, payload], end ["", -1, ""]).
SGLang's batches are [ts, events, attn_dp_rank]; before 0.5.23 its replay answers
[seq, payload], ending [-1, ""].

The structures are written here from those sources (vLLM 0.32.0's wheel, SGLang's repository
in December 2026), not imported, so the tests need only msgspec and pyzmq.

It binds a PUB and a ROUTER (replay) socket on 127.0.0.1 (free ports), prints one JSON line
{"endpoint": ..., "replay": ...}, then reads one JSON command per line from stdin and answers
each with one JSON line:
  {"publish": [event, ...]}             the next batch, live and into the replay buffer
  {"publish": [...], "live": false}     into the buffer only (a batch the router missed live)
  {"raw": "hex"}                         a payload as given (an undecodable batch)
  {"restart": true}                      a new run: both sockets closed and bound again on the
                                         same ports, sequence from 0, the buffer empty
With --data-parallel-size N it is N ranks, as vLLM's data-parallel engines are: rank r binds
the PUB port + r and the ROUTER port + r (vLLM's offset_endpoint_port), stamps its batches with
data_parallel_rank r and keeps a sequence and buffer of its own; a command's "rank" (default 0)
says which rank publishes or restarts. The first line names rank 0's sockets.
An event is a JSON object with "type" and the fields by vLLM's names ({"as_is": map} sends
the map unchanged, for an unreadable event); "bigram": true sends
token ids as SGLang's EAGLE pairs (t_i, t_i+1). The answer is {"seq": n} (or {"restarted": 1}).
"""

import json
import queue
import random
import sys
import threading
import time
from typing import Any, Optional, Union

import msgspec
import zmq

# vLLM 0.32.0 ------------------------------------------------------------------------------


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


# SGLang -----------------------------------------------------------------------------------


class SglBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class SglArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class Sgl0BlockStored(SglArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]


class Sgl0BlockRemoved(SglArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class SglAllBlocksCleared(SglArrayEvent, tag="AllBlocksCleared"):
    pass


class SglMetadata(msgspec.Struct, omit_defaults=True, gc=False):
    cache_salt: str


class SglBlockStored(SglArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class SglBlockStoredWithMetadata(SglBlockStored, tag="BlockStored", kw_only=True):
    metadata: SglMetadata


class SglBlockRemoved(SglArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class SglMapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class SglMapBlockStored(SglMapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    # Since 0.5.23.
    lora_name: Optional[str] = None


class SglMapBlockRemoved(SglMapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class SglMapAllBlocksCleared(SglMapEvent, tag="AllBlocksCleared"):
    pass


END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def tokens(event: dict) -> list:
    ids = event["token_ids"]
    if event.get("bigram"):
        # EAGLE's bigram keys: position i carries (t_i, t_i+1); the page's last pairs with the
        # next token (here: itself plus one, the value does not matter to a router).
        return [(ids[i], ids[i + 1] if i + 1 < len(ids) else ids[i] + 1) for i in range(len(ids))]
    return ids


def vllm_event(event: dict):
    if "as_is" in event:
        # Sent as given (a map no engine would send: an event a router cannot read).
        return event["as_is"]
    kind = event["type"]
    if kind == "BlockStored":
        return VllmBlockStored(
            block_hashes=event["block_hashes"],
            parent_block_hash=event.get("parent_block_hash"),
            token_ids=event["token_ids"],
            block_size=event["block_size"],
            lora_id=event.get("lora_id"),
            medium=event.get("medium", "GPU"),
            lora_name=event.get("lora_name"),
            extra_keys=event.get("extra_keys"),
            group_idx=event.get("group_idx", 0),
            kv_cache_spec_kind=event.get("kv_cache_spec_kind", "full_attention"),
            kv_cache_spec_sliding_window=event.get("kv_cache_spec_sliding_window"),
            locality=event.get("locality"),
        )
    if kind == "BlockRemoved":
        return VllmBlockRemoved(
            block_hashes=event["block_hashes"],
            medium=event.get("medium", "GPU"),
            group_idx=event.get("group_idx", 0),
            locality=event.get("locality"),
        )
    return VllmAllBlocksCleared()


def sglang_event(flavor: str, event: dict):
    kind = event["type"]
    common = dict(
        block_hashes=event.get("block_hashes", []),
    )
    if kind == "BlockStored":
        stored = dict(
            common,
            parent_block_hash=event.get("parent_block_hash"),
            token_ids=tokens(event),
            block_size=event["block_size"],
            lora_id=None,
        )
        if flavor == "sglang-0":
            return Sgl0BlockStored(**stored)
        medium = event.get("medium", "GPU")
        salt = event.get("cache_salt")
        if flavor == "sglang-map":
            return SglMapBlockStored(**stored, medium=medium, cache_salt=salt)
        if flavor == "sglang-0.5.23":
            return SglMapBlockStored(
                **stored, medium=medium, cache_salt=salt, lora_name=event.get("lora_name")
            )
        if salt is not None:
            return SglBlockStoredWithMetadata(
                **stored, medium=medium, metadata=SglMetadata(cache_salt=salt)
            )
        return SglBlockStored(**stored, medium=medium)
    if kind == "BlockRemoved":
        if flavor == "sglang-0":
            return Sgl0BlockRemoved(**common)
        medium = event.get("medium", "GPU")
        if flavor in ("sglang-map", "sglang-0.5.23"):
            return SglMapBlockRemoved(**common, medium=medium)
        return SglBlockRemoved(**common, medium=medium)
    if flavor in ("sglang-map", "sglang-0.5.23"):
        return SglMapAllBlocksCleared()
    return SglAllBlocksCleared()


class Publisher:
    def __init__(self, flavor: str, rank: int = 0, ports: tuple = (0, 0), context=None):
        self.flavor = flavor
        self.vllm = flavor.startswith("vllm")
        # vLLM's replay answers carry the topic frame; SGLang's do since 0.5.23.
        self.topic_in_replay = self.vllm or flavor == "sglang-0.5.23"
        self.rank = rank
        self.context = context or zmq.Context()
        self.encoder = msgspec.msgpack.Encoder()
        self.pub_port, self.replay_port = ports
        self.bind()

    def bind(self) -> None:
        self.pub = self.context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay = self.context.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        if self.pub_port:
            # A restarted engine binds the same ports; the old ones may linger a moment. A
            # first bind on chosen ports (a data-parallel rank) tries once.
            tries = 100 if hasattr(self, "seq") else 1
            for socket, port in ((self.pub, self.pub_port), (self.replay, self.replay_port)):
                for _ in range(tries):
                    try:
                        socket.bind(f"tcp://127.0.0.1:{port}")
                        break
                    except zmq.ZMQError as error:
                        failure = error
                        time.sleep(0.05)
                else:
                    self.pub.close(linger=0)
                    self.replay.close(linger=0)
                    raise SystemExit(f"cannot bind port {port}: {failure}")
        else:
            # Above the kernel's ephemeral range (ip_local_port_range, 32768-60999 here):
            # while the ports are closed for a restart, a subscriber reconnecting to them could
            # otherwise be given the same port as its own source and connect to itself,
            # holding the port.
            self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1", 61000, 65535)
            self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1", 61000, 65535)
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []

    def batch(self, events: list) -> bytes:
        if self.vllm:
            batch = VllmBatch(ts=time.time(), events=[vllm_event(e) for e in events])
            # vLLM's publish() fills in the publisher's rank.
            batch.data_parallel_rank = self.rank
        else:
            batch = SglBatch(
                ts=time.time(),
                events=[sglang_event(self.flavor, e) for e in events],
                attn_dp_rank=self.rank,
            )
        return self.encoder.encode(batch)

    def publish(self, payload: bytes, live: bool) -> int:
        seq = self.seq
        self.seq += 1
        seq_bytes = seq.to_bytes(8, "big")
        if live:
            self.pub.send_multipart((b"", seq_bytes, payload))
        self.buffer.append((seq, payload))
        return seq

    def serve_replay(self) -> None:
        while self.replay.poll(0):
            frames = self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= start:
                    if self.topic_in_replay:
                        answer = (client, b"", b"", seq.to_bytes(8, "big"), payload)
                    else:
                        answer = (client, b"", seq.to_bytes(8, "big"), payload)
                    self.replay.send_multipart(answer)
            if self.topic_in_replay:
                self.replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))
            else:
                self.replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def restart(self) -> None:
        self.pub.close(linger=0)
        self.replay.close(linger=0)
        self.bind()


def ranks(flavor: str, size: int) -> list:
    """size publishers on consecutive ports (PUB base + r, ROUTER base + size + r)."""
    if size == 1:
        return [Publisher(flavor)]
    context = zmq.Context()
    failure = None
    for _ in range(100):
        base = random.randrange(61000, 65535 - 2 * size)
        made = []
        try:
            for rank in range(size):
                made.append(Publisher(flavor, rank, (base + rank, base + size + rank), context))
            return made
        except SystemExit as error:
            failure = error
            for publisher in made:
                publisher.pub.close(linger=0)
                publisher.replay.close(linger=0)
    raise SystemExit(f"no {2 * size} free consecutive ports: {failure}")


def main() -> None:
    flavor = sys.argv[1]
    size = int(sys.argv[3]) if sys.argv[2:3] == ["--data-parallel-size"] else 1
    publishers = ranks(flavor, size)
    print(
        json.dumps(
            {
                "endpoint": f"tcp://127.0.0.1:{publishers[0].pub_port}",
                "replay": f"tcp://127.0.0.1:{publishers[0].replay_port}",
                "data_parallel_size": size,
            }
        ),
        flush=True,
    )
    commands: "queue.Queue[Optional[str]]" = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            commands.put(line)
        commands.put(None)

    threading.Thread(target=read, daemon=True).start()
    while True:
        for publisher in publishers:
            publisher.serve_replay()
        try:
            line = commands.get(timeout=0.005)
        except queue.Empty:
            continue
        if line is None:
            break
        command = json.loads(line)
        publisher = publishers[command.get("rank", 0)]
        if command.get("restart"):
            publisher.restart()
            print(json.dumps({"restarted": 1}), flush=True)
            continue
        if "raw" in command:
            payload = bytes.fromhex(command["raw"])
        else:
            payload = publisher.batch(command["publish"])
        seq = publisher.publish(payload, command.get("live", True))
        print(json.dumps({"seq": seq}), flush=True)


if __name__ == "__main__":
    main()
