"""The attach event layer (issue 17): vLLM's KV events decoded from captured and rebuilt frames, the prefix
tree they describe, and the subscriber against an in-process publisher with vLLM's framing."""

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from support.tui import async_test
from support.vllm_server import vllm_python, vllm_server

from pagedchat.attach import kv_events
from pagedchat.attach.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventStream,
    decode_batch,
    parse_kv_events,
    rank_endpoints,
)
from pagedchat.attach.prefix_tree import EVICTIONS_KEPT, Eviction, PrefixTree

FIXTURES = Path(__file__).parent / "fixtures" / "kv_events"


def read_lines(name: str) -> list[dict]:
    """A fixture's JSON lines, payloads decoded from base64."""
    lines = [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]
    for line in lines:
        if "payload" in line:
            line["payload"] = base64.b64decode(line["payload"])
    return lines


def shared_blocks(prompt_a: list[int], prompt_b: list[int], size: int) -> int:
    """How many whole blocks two prompts share from the start."""
    return next(i for i, (a, b) in enumerate(zip(prompt_a, prompt_b)) if a != b) // size


# ---- the current encoding, captured from vLLM 0.32.0 --------------------------------------------------

@pytest.mark.parametrize("name, hash_type", [("current_int.jsonl", int), ("current_bytes.jsonl", bytes)])
def test_captured_batches_hold_the_prompts_blocks(name, hash_type):
    meta, *frames = read_lines(name)
    size = meta["block_size"]
    prompt_a, prompt_b = meta["prompt_token_ids"]
    shared = shared_blocks(prompt_a, prompt_b, size)
    assert 0 < shared < len(prompt_b) // size  # the system prompt fills blocks, the second chat adds one
    assert {"group_idx", "kv_cache_spec_kind"} <= msgspec.msgpack.decode(frames[0]["payload"])[1][0].keys()
    batches = [decode_batch(f["seq"], f["payload"]) for f in frames]
    assert [b.seq for b in batches] == list(range(len(batches))) and {b.rank for b in batches} == {0}
    events = [e for b in batches for e in b.events]
    first, second, cleared, again = events
    # The first chat stores its prompt's full blocks in one event, chained from the top.
    assert isinstance(first, BlockStored) and first.parent_block_hash is None and first.block_size == size
    assert first.token_ids == tuple(prompt_a[:len(prompt_a) // size * size])
    assert all(type(h) is hash_type for h in first.block_hashes)
    assert hash_type is int or all(len(h) == 32 for h in first.block_hashes)
    # The second reuses the shared blocks and stores the rest under the last of them.
    assert isinstance(second, BlockStored) and second.parent_block_hash == first.block_hashes[shared - 1]
    assert second.token_ids == tuple(prompt_b[shared * size:len(prompt_b) // size * size])
    # After the reset the first chat's blocks come back with the same hashes: a hash names its prefix.
    assert isinstance(cleared, AllBlocksCleared) and again == first

    tree = PrefixTree()
    for batch in batches[:2]:
        tree.apply(batch)
    assert tree.match(prompt_b) == list(first.block_hashes[:shared] + second.block_hashes)
    tree.apply(batches[2])  # the reset and the first chat again
    assert tree.match(prompt_a) == list(first.block_hashes) and len(tree) == len(first.block_hashes)
    assert tree.match(prompt_b) == list(first.block_hashes[:shared])


# ---- older encodings, built from the older releases' own structs ------------------------------------

@pytest.mark.parametrize("release", ["v0.9", "v0.11", "map-batch"])
def test_older_encodings_decode(release):
    batches = [decode_batch(f["seq"], f["payload"]) for f in read_lines("older.jsonl") if f["release"] == release]
    h = (lambda i: i * 1_000_003) if release == "v0.9" else (lambda i: i.to_bytes(32, "big"))
    expected = [
        (BlockStored((h(1), h(2), h(3)), None, tuple(range(12)), 4),),
        (BlockStored((h(4),), h(2), (40, 41, 42, 43), 4), BlockRemoved((h(3),))),
    ]
    if release != "v0.9":
        expected.append(())  # the store on the CPU offload tier is left out
    expected.append((AllBlocksCleared(),))
    assert [b.events for b in batches] == expected
    assert [b.ts for b in batches][:2] == [1.5, 2.5] and {b.rank for b in batches} == {1}


@pytest.mark.parametrize("payload", [
    b"\xc1",  # not msgpack
    msgspec.msgpack.encode("hello"),
    msgspec.msgpack.encode([1.0, "events"]),
    msgspec.msgpack.encode([1.0, [42]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1, 2], None, [1, 2, 3], 2, None]]]),  # 3 tokens, 2 blocks
    msgspec.msgpack.encode([1.0, [["BlockStored", [1.5], None, [1, 2], 2, None]]]),
    msgspec.msgpack.encode({"ts": 1.0}),
])
def test_garbage_is_a_value_error(payload):
    with pytest.raises(ValueError, match="KV event batch 7"):
        decode_batch(7, payload)


def test_equal_hashes_compare_equal_and_unknown_events_are_skipped():
    payload = msgspec.msgpack.encode([0.5, [{"type": "BlockRemoved", "block_hashes": [b"\x01" * 32, 5],
                                              "medium": "GPU", "future_field": 1},
                                             {"type": "SomethingNew", "x": 1}], 0])
    (removed,) = decode_batch(0, payload).events
    assert removed == BlockRemoved((bytes(b"\x01" * 32), 5)) and hash(removed)


# ---- the CLI value ----------------------------------------------------------------------------------

def test_parse_kv_events():
    assert parse_kv_events("tcp://10.0.0.2:5557") == ("tcp://10.0.0.2:5557", None)
    assert parse_kv_events("tcp://host:5557,replay=5600") == ("tcp://host:5557", "tcp://host:5600")
    assert rank_endpoints("tcp://host:5557", "tcp://host:5600", 2) == ("tcp://host:5559", "tcp://host:5602")
    assert rank_endpoints("tcp://host:5557", None, 0) == ("tcp://host:5557", None)


@pytest.mark.parametrize("value", ["5557", "http://h:5557", "tcp://:5557", "tcp://*:5557", "tcp://h:port",
                                   "tcp://h:70000", "tcp://h:5557,replay=x", "tcp://h:5557,again=5558",
                                   "tcp://h:5557,replay=1,replay=2"])
def test_parse_kv_events_rejects(value):
    with pytest.raises(ValueError, match="^--kv-events: ") as error:
        parse_kv_events(value)
    assert "\n" not in str(error.value)


# ---- the prefix tree --------------------------------------------------------------------------------

def batch(seq: int, *events) -> EventBatch:
    return EventBatch(seq, float(seq), events, 0)


def test_prefix_tree_by_hand():
    tree = PrefixTree()
    assert tree.match([1, 2, 3]) == [] and tree.roots() == []  # no block size before any event
    tree.apply(batch(0, BlockStored(("a", "b", "c"), None, (1, 2, 3, 4, 5, 6), 2)))  # one event, 3 blocks
    tree.apply(batch(1, BlockStored(("d",), "a", (7, 8), 2)))
    assert [n.hash for n in tree.roots()] == ["a"]
    assert [(n.hash, n.parent, n.token_ids, n.stored_seq) for n in tree.children("a")] == [
        ("b", "a", (3, 4), 0), ("d", "a", (7, 8), 1)]
    assert tree.match([1, 2, 3, 4, 5, 6, 9]) == ["a", "b", "c"]  # the tail is not a whole block
    assert tree.match([1, 2, 3, 4, 9, 9, 5, 6]) == ["a", "b"]  # stops at the first miss
    assert tree.match([1, 2, 7, 8, 5, 6]) == ["a", "d"]
    assert tree.match([3, 4]) == []  # a block matches under its parent only

    tree.apply(batch(2, BlockStored(("c",), "b", (5, 6), 2)))  # reported again: nothing changes
    assert tree.nodes["c"].stored_seq == 0 and len(tree) == 4

    tree.apply(batch(3, BlockRemoved(("b", "unknown"))))  # b evicted before its child c
    assert list(tree.evictions) == [Eviction(3, "b", 2)]
    assert [n.hash for n in tree.roots()] == ["a", "c"] and tree.orphan("c") and not tree.orphan("a")
    assert tree.match([1, 2, 3, 4, 5, 6]) == ["a"]

    tree.apply(batch(4, BlockStored(("x",), "before-attach", (9, 9), 2)))  # parent never seen
    assert [n.hash for n in tree.roots()] == ["a", "c", "x"] and tree.orphan("x")
    assert tree.match([9, 9]) == []  # vLLM matches from the first block, and so does the tree

    tree.apply(batch(5, BlockStored(("b",), "a", (3, 4), 2)))  # recomputed: c is b's child again
    assert [n.hash for n in tree.roots()] == ["a", "x"] and not tree.orphan("c")
    assert tree.match([1, 2, 3, 4, 5, 6]) == ["a", "b", "c"]

    tree.apply(batch(6, BlockRemoved(("c",)), BlockRemoved(("x",))))
    assert [n.hash for n in tree.roots()] == ["a"] and tree.children("b") == []
    tree.apply(batch(7, AllBlocksCleared()))
    assert len(tree) == 0 and tree.roots() == [] and not tree.evictions and tree.match([1, 2]) == []


def test_prefix_tree_siblings_with_the_same_tokens_and_bounded_evictions():
    tree = PrefixTree()
    # Same tokens, other hashes: what a LoRA or a cache salt makes. Either one matches while resident.
    tree.apply(batch(0, BlockStored((1,), None, (5, 5), 2), BlockStored((2,), None, (5, 5), 2)))
    assert tree.match([5, 5]) in ([1], [2])
    tree.apply(batch(1, BlockRemoved((1,))))
    assert tree.match([5, 5]) == [2]
    for seq in range(2, EVICTIONS_KEPT + 10):
        tree.apply(batch(seq, BlockStored((seq * 10,), None, (seq, seq), 2), BlockRemoved((seq * 10,))))
    assert len(tree.evictions) == EVICTIONS_KEPT and tree.evictions[-1].seq == EVICTIONS_KEPT + 9


# ---- the stream, against a publisher with vLLM's framing ----------------------------------------------

class Publisher:
    """vLLM's ZmqEventPublisher in miniature: PUB (an XPUB, to see the subscriber join) and a ROUTER
    replaying a bounded buffer. `topic_in_replay`: vLLM 0.32's answers; False: the older ones."""

    def __init__(self, buffer: int = 100, topic_in_replay: bool = True) -> None:
        ctx = zmq.asyncio.Context.instance()
        self.pub, self.router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router.bind("tcp://127.0.0.1:0")
        self.endpoint, self.replay = (s.getsockopt_string(zmq.LAST_ENDPOINT) for s in (self.pub, self.router))
        self.buffer: list[tuple[int, bytes]] = []
        self.keep, self.topic_in_replay = buffer, topic_in_replay
        self.replays: list[int] = []
        self.task = asyncio.create_task(self.serve_replay())

    async def subscribed(self) -> None:
        assert (await asyncio.wait_for(self.pub.recv(), 5))[0] == 1

    async def publish(self, send: bool = True) -> None:
        """The next batch; `send=False`: it is lost on the way (still in the replay buffer)."""
        seq = self.buffer[-1][0] + 1 if self.buffer else 0
        payload = msgspec.msgpack.encode([float(seq), [["BlockRemoved", [seq], "GPU"]], 0])
        self.buffer = (self.buffer + [(seq, payload)])[-self.keep:]
        if send:
            await self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    async def serve_replay(self) -> None:
        topic = (b"",) if self.topic_in_replay else ()
        while True:
            client, empty, start = await self.router.recv_multipart()
            self.replays.append(int.from_bytes(start, "big"))
            for seq, payload in self.buffer:
                if seq >= self.replays[-1]:
                    await self.router.send_multipart((client, empty, *topic, seq.to_bytes(8, "big"), payload))
            await self.router.send_multipart((client, empty, *topic, (-1).to_bytes(8, "big", signed=True), b""))

    def close(self) -> None:
        self.task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def take(batches: AsyncIterator[EventBatch], n: int) -> list[int]:
    return [(await asyncio.wait_for(anext(batches), 5)).seq for _ in range(n)]


@pytest.mark.parametrize("topic_in_replay", [True, False])
@async_test
async def test_late_attach_replays_from_zero_and_a_gap_is_replayed(topic_in_replay):
    server = Publisher(topic_in_replay=topic_in_replay)
    for _ in range(2):
        await server.publish()  # before the attach: nobody hears them
    stream = KVEventStream(server.endpoint, server.replay)
    await server.subscribed()
    await server.publish()  # heard, and replayed too
    batches = stream.batches()
    assert await take(batches, 3) == [0, 1, 2] and server.replays == [0]
    await server.publish()
    assert await take(batches, 1) == [3]  # the live copy of 2 was dropped
    await server.publish(send=False)
    await server.publish(send=False)
    await server.publish()
    assert await take(batches, 3) == [4, 5, 6] and server.replays == [0, 4]
    await server.publish()
    assert await take(batches, 1) == [7] and not stream.partial and stream.last_seq == 7
    stream.close()
    server.close()


@async_test
async def test_a_rolled_over_buffer_leaves_the_stream_partial():
    server = Publisher(buffer=2)
    for _ in range(5):
        await server.publish()
    stream = KVEventStream(server.endpoint, server.replay)
    batches = stream.batches()
    assert await take(batches, 2) == [3, 4] and stream.partial
    stream.close()
    server.close()


@async_test
async def test_without_replay_only_a_stream_seen_from_seq_zero_is_whole():
    server = Publisher()
    stream = KVEventStream(server.endpoint, None)
    assert stream.partial
    batches = stream.batches()
    first = asyncio.ensure_future(take(batches, 1))
    await server.subscribed()
    await server.publish()
    assert await first == [0] and not stream.partial
    await server.publish(send=False)
    await server.publish()
    assert await take(batches, 1) == [2] and stream.partial and server.replays == []
    stream.close()
    server.close()


@async_test
async def test_a_silent_replay_socket_and_closing(monkeypatch):
    monkeypatch.setattr(kv_events, "REPLAY_TIMEOUT_S", 0.2)
    server = Publisher()
    await server.publish(send=False)
    silent = zmq.asyncio.Context.instance().socket(zmq.ROUTER)  # bound, never answers
    silent.bind("tcp://127.0.0.1:0")
    stream = KVEventStream(server.endpoint, silent.getsockopt_string(zmq.LAST_ENDPOINT))
    batches = stream.batches()
    waiting = asyncio.ensure_future(take(batches, 1))
    await server.subscribed()
    await server.publish()
    assert await waiting == [1] and stream.partial  # both replays (from 0) timed out: it went on live
    waiting = asyncio.ensure_future(anext(batches))
    await asyncio.sleep(0.05)
    stream.close()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(waiting, 5)
    silent.close(linger=0)
    server.close()


# ---- against a real vLLM server ---------------------------------------------------------------------

@pytest.mark.vllm
@pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (python -m bench.peers setup)")
@async_test
async def test_attach_to_a_real_vllm_server():
    meta = read_lines("current_int.jsonl")[0]
    chat_a, chat_b = meta["chats"]
    prompt_a, prompt_b = meta["prompt_token_ids"]
    size = meta["block_size"]
    with vllm_server() as (base, kv_events_value):
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]

            async def chat(messages):
                body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}
                (await client.post("/v1/chat/completions", json=body)).raise_for_status()

            await chat(chat_a)  # before the attach
            stream = KVEventStream(*parse_kv_events(kv_events_value))
            tree = PrefixTree()
            batches = stream.batches()

            async def until_matched(prompt):
                while len(tree.match(prompt)) < len(prompt) // size:
                    tree.apply(await asyncio.wait_for(anext(batches), 30))

            await until_matched(prompt_a)  # replayed
            await chat(chat_b)
            await until_matched(prompt_b)  # live
            stream.close()
    shared = shared_blocks(prompt_a, prompt_b, size)
    assert tree.match(prompt_b)[:shared] == tree.match(prompt_a)[:shared] and not stream.partial
    assert tree.match(prompt_b)[shared] not in tree.match(prompt_a)
