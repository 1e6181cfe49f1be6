"""`pagedchat serve` on 127.0.0.1 with the tiny model, driven by real clients: the openai SDK and raw HTTP.

Every request loop is bounded; every wait has a deadline.
"""

import asyncio
import contextlib
import json
import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.engine import make_llm
from support.serve import GREEDY, KEY, POOL, Live, wait_for

from pagedchat import SamplingParams
from pagedchat.engine.chat import ChatSession
from pagedchat.engine.worker import compiled_decode


@pytest.fixture(scope="module")
def live(tiny_model):
    server = Live(tiny_model)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(tiny_model):
    return make_llm(tiny_model, **POOL)


def test_chat_equals_llm_chat_token_for_token(live, reference):
    messages = [{"role": "user", "content": "Tell me about paged attention."}]
    expected = reference.chat(messages, SamplingParams(max_tokens=12, **GREEDY))[0]
    whole = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                extra_body={"return_token_ids": True})
    assert whole.choices[0].token_ids == expected.token_ids
    assert whole.choices[0].message.content == expected.text
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids) and whole.usage.completion_tokens == 12
    assert whole.id.startswith("chatcmpl-")

    chunks = list(live.client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = [t for c in chunks for choice in c.choices for t in (getattr(choice, "token_ids", None) or [])]
    assert streamed == expected.token_ids
    assert "".join(choice.delta.content or "" for c in chunks for choice in c.choices) == expected.text
    assert [choice.finish_reason for c in chunks for choice in c.choices if choice.finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    live.wait_until_idle()


def test_completions_take_token_ids_and_text(live, reference):
    prompt = list(range(60, 80))
    expected = reference.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    out = live.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                   "return_token_ids": True}).json()
    assert out["object"] == "text_completion" and out["choices"][0]["token_ids"] == expected.token_ids
    text = live.client.completions.create(model="tiny", prompt="abc", max_tokens=3, temperature=0)
    assert text.usage.prompt_tokens == 3 and text.usage.completion_tokens == 3  # byte-level: one token a byte


def test_n_samples_and_seeds(live):
    out = live.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, n=2, seed=5, temperature=1.0)
    again = live.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=6, n=2, seed=5, temperature=1.0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.message.content for c in out.choices] == [c.message.content for c in again.choices]
    assert out.usage.completion_tokens == 12
    live.wait_until_idle()


def test_a_session_continues_and_its_second_turn_is_served_from_its_blocks(live, reference):
    messages = [{"role": "user", "content": "First question?"}]
    first = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                extra_body={"session_id": "s1", "return_token_ids": True})
    snap = live.snapshot()
    assert [r["request_id"] for r in snap["requests"]] == [first.id]  # kept: parked with its blocks
    assert snap["requests"][0]["status"] == "parked"
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And a second one?"}]
    second = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 extra_body={"session_id": "s1"})
    assert second.id == first.id, "the same engine request goes on"
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    # The reply's own tokens, not its text re-tokenized, are the history (as in the app's ChatSession).
    chat = ChatSession(reference.get_tokenizer())
    chat.user_turn(messages[0]["content"])
    chat.add_reply(first.choices[0].token_ids, first.choices[0].message.content)
    chat.user_turn(messages[2]["content"])
    assert second.usage.prompt_tokens == chat.num_tokens

    other = live.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "New topic"}],
                                                max_tokens=4, temperature=0,
                                                extra_body={"session_id": "s1"})
    assert other.id != first.id, "another history starts a new request"
    assert first.id not in [r["request_id"] for r in live.snapshot()["requests"]], "the old one is closed"
    live.state.served.sessions.close("s1")
    live.wait_until_idle()


def test_sixteen_streaming_clients_all_finish_and_the_pool_is_whole(live):
    async def one(client: openai.AsyncOpenAI, number: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Client {number} says hello"}], max_tokens=10,
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        reasons, used = [], 0
        async for chunk in stream:
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            used = chunk.usage.completion_tokens if chunk.usage else used
        return reasons, used

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, n) for n in range(16)))
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    assert results == [(["length"], 10)] * 16
    snap = live.wait_until_idle()
    assert snap["requests"] == []


def streaming_request(live, body: dict) -> tuple[httpx.Client, httpx.Response]:
    """A streaming request whose response the caller reads a little of, then closes (a disconnect)."""
    client = httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    request = client.build_request("POST", "/v1/chat/completions", json=body | {"stream": True})
    return client, client.send(request, stream=True)


@contextlib.contextmanager
def paused(live):
    """The engine steps only when told to (step_once), so a disconnect alone must free the blocks."""
    live.engine_thread.set_paused(True)
    try:
        yield live.engine_thread
    finally:
        live.engine_thread.set_paused(False)


def stopped_and_freed(live) -> None:
    """Nothing runs or waits and every block is free. The engine is paused: the request is stopped by
    the disconnect alone (it is forgotten at the next step, which reports its end)."""
    def done() -> bool:
        snap = live.snapshot()
        return (snap["num_running"] == snap["num_waiting"] == 0 and snap["num_free_blocks"] == snap["num_blocks"]
                and all(r["status"] == "finished" and not r["block_table"] for r in snap["requests"]))
    wait_for(done, "the request to stop and its blocks to be free")


def test_a_client_that_leaves_mid_decode_frees_its_blocks_at_once(live):
    client, response = streaming_request(live, {"messages": [{"role": "user", "content": "Talk for long"}],
                                                "max_tokens": 300, "ignore_eos": True, "temperature": 0})
    assert response.status_code == 200
    lines = response.iter_lines()
    for _ in range(3):  # the role, then content: decoding has begun
        while not next(lines).startswith("data: "):
            pass
    with paused(live):
        assert any(r["status"] == "running" for r in live.snapshot()["requests"])
        response.close()
        client.close()
        stopped_and_freed(live)


def test_a_client_that_leaves_during_a_chunked_prefill_frees_its_blocks(live):
    with paused(live) as engine:
        long_message = "x" * 200  # 200 byte tokens: chunks of max_num_batched_tokens = 32
        client, response = streaming_request(live, {"messages": [{"role": "user", "content": long_message}],
                                                    "max_tokens": 5, "temperature": 0})
        wait_for(lambda: live.snapshot()["num_waiting"] == 1, "the request to arrive")
        for step in range(2):
            engine.step_once()
        wait_for(lambda: (r := live.snapshot()["requests"]) and 0 < r[0]["num_computed_tokens"] < 200, "a part-prefill")
        response.close()
        client.close()
        stopped_and_freed(live)


def test_a_client_that_leaves_while_waiting_in_the_queue_is_dropped(live):
    with paused(live):
        client, response = streaming_request(live, {"messages": [{"role": "user", "content": "queued"}],
                                                    "max_tokens": 5})
        wait_for(lambda: live.snapshot()["num_waiting"] == 1, "the request to wait")
        response.close()
        client.close()
        stopped_and_freed(live)


def test_a_non_streamed_client_that_leaves_ends_its_request(live):
    with paused(live):
        done = threading.Event()

        def leave_early() -> None:
            with pytest.raises(httpx.ReadTimeout):
                live.http.post("/v1/chat/completions", timeout=1.0, json={
                    "messages": [{"role": "user", "content": "never answered"}], "max_tokens": 50})
            done.set()

        caller = threading.Thread(target=leave_early)
        caller.start()
        wait_for(lambda: live.snapshot()["num_waiting"] == 1, "the request to arrive")
        caller.join(10)
        assert done.is_set()
        stopped_and_freed(live)


@pytest.mark.parametrize("case, status, param", [
    ("bad json", 400, None),
    ("unknown model", 404, "model"),
    ("max_tokens past the context", 400, "max_tokens"),
    ("prompt larger than the pool", 400, "messages"),
    ("wrong key", 401, None),
    ("schema", 400, "temperature"),
    ("tools", 400, "tools"),
])
def test_bad_requests_get_one_error_object_and_the_server_goes_on(live, case, status, param):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = json.dumps({
        "unknown model": chat | {"model": "gpt-4"},
        "max_tokens past the context": chat | {"max_tokens": 10_000},
        "prompt larger than the pool": chat | {"messages": [{"role": "user", "content": "y" * 500}]},
        "schema": chat | {"temperature": "hot"},
        "tools": chat | {"tools": [{"type": "function", "function": {"name": "f"}}]},
    }.get(case, chat))
    if case == "bad json":
        content = '{"messages": ['
    if case == "wrong key":
        headers["Authorization"] = "Bearer nope"
    response = httpx.post(f"{live.url}/v1/chat/completions", content=content, headers=headers, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["param"] == param
    assert live.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ok?"}],
                                               max_tokens=2).choices[0].finish_reason in ("stop", "length")



CHAT = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'


@pytest.mark.parametrize("method, path, content, content_type, status, says", [
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \xff"}]}', "application/json",
     400, "not valid UTF-8"),
    ("POST", "/v1/chat/completions", b'{"messages": [', "application/json", 400, "not valid JSON"),
    ("POST", "/v1/chat/completions", CHAT, "text/plain", 400, "must be a JSON object"),
    ("POST", "/v1/chat/completions", CHAT, None, 400, "must be a JSON object"),
    ("POST", "/v1/chat/completions", b"", "application/json", 400, "must be a JSON object"),
    ("POST", "/v1/chat/completions", b"[1, 2]", "application/json", 400, "must be a JSON object"),
    ("POST", "/v1/completions", b'{"prompt": "' + b"y" * 1_000_000 + b'"}', "application/json", 400, "context"),
    ("POST", "/tokenize", b'{"prompt": "\xc3("}', "application/json", 400, "not valid UTF-8"),
    ("POST", "/v1/no/such/endpoint", CHAT, "application/json", 404, "no such endpoint: POST /v1/no/such/endpoint"),
    ("GET", "/v1/chat/completions", None, None, 405, "does not take GET"),
    ("DELETE", "/v1/models", None, None, 405, "does not take DELETE"),
    ("GET", "/v1/kv/events?since=soon", None, None, 400, "since"),
])
def test_what_fastapi_answers_by_itself_is_an_openai_error_too(live, method, path, content, content_type, status,
                                                               says):
    headers = {"Authorization": f"Bearer {KEY}"} | ({"Content-Type": content_type} if content_type else {})
    response = httpx.request(method, f"{live.url}{path}", content=content, headers=headers, timeout=60)
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"}
    error = response.json()["error"]
    assert error["code"] == status and says in error["message"] and error["type"].endswith("Error")


def test_the_sdk_reads_those_errors(live):
    with pytest.raises(openai.NotFoundError) as raised:
        live.client.models.retrieve("tiny")  # GET /v1/models/tiny: no such endpoint here
    assert raised.value.body["message"] == "no such endpoint: GET /v1/models/tiny"
    with pytest.raises(openai.APIStatusError) as raised:
        live.client.get("/chat/completions", cast_to=object)
    assert raised.value.status_code == 405 and "does not take GET" in raised.value.body["message"]


def test_a_bug_is_answered_with_an_openai_error_object(live, monkeypatch):
    def broken():
        raise RuntimeError("a bug")

    monkeypatch.setattr(live.state.served.engine, "snapshot", broken)
    # a connection of its own: uvicorn closes the one whose request raised
    response = httpx.get(f"{live.url}/v1/kv/snapshot", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "internal error: RuntimeError: a bug"

def test_fields_that_ask_for_nothing_pass(live):
    out = live.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": False, "tools": [],
        "presence_penalty": 0, "response_format": {"type": "text"}, "some_future_field": 1})
    assert out.status_code == 200


def test_health_and_metrics_stay_open_and_metrics_parse(live):
    assert httpx.get(f"{live.url}/health").status_code == 200
    assert httpx.get(f"{live.url}/v1/models").status_code == 401
    models = live.client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].max_model_len == live.state.served.max_model_len
    live.client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2)  # something to count
    text = httpx.get(f"{live.url}/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:cache_config_info"):
        assert name in families, name
    labels = families["vllm:cache_config_info"].samples[0].labels
    assert labels["block_size"] == "4" and labels["num_gpu_blocks"] == "96"
    assert families["vllm:generation_tokens"].samples[0].value > 0
    assert families["pagedchat:decode_compiling"].samples[0].value == 0  # compile=False


def test_metrics_say_while_a_decode_step_compiles(live):
    def compiling_now() -> float:
        text = httpx.get(f"{live.url}/metrics").text
        return {f.name: f for f in text_string_to_metric_families(text)}["pagedchat:decode_compiling"].samples[0].value

    done = threading.Event()
    stand_in = threading.Thread(target=done.wait, name=compiled_decode.THREAD_NAME)  # as the compile thread runs
    stand_in.start()
    try:
        assert compiling_now() == 1
    finally:
        done.set()
        stand_in.join()
    assert compiling_now() == 0


def test_tokenize_and_detokenize_round_trip(live):
    tokens = live.http.post("/tokenize", json={"prompt": "héllo"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == 6  # bytes
    assert live.http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "héllo"}


def test_block_events_resume_from_a_seq_or_say_resync(live):
    live.client.completions.create(model="tiny", prompt=[5, 6, 7, 8, 9], max_tokens=2)
    events = live.snapshot()["events"]
    since = events[-3]["seq"]
    with live.http.stream("GET", "/v1/kv/events", params={"since": since}) as response:
        got = []
        for line in response.iter_lines():
            if line.startswith("id: "):
                got.append(int(line[4:]))
            if len(got) == 2:
                break
    assert got == [events[-2]["seq"], events[-1]["seq"]]
    with live.http.stream("GET", "/v1/kv/events", params={"since": -5}) as response:
        first = next(line for line in response.iter_lines() if line)
    assert first == "event: resync" or events[0]["seq"] == 0
    blocks = live.snapshot()["blocks"]
    assert all(b["block_hash"] is None or isinstance(b["block_hash"], str) for b in blocks)
