"""The serving benchmark's statistics, stream parsing and report, without starting a server."""

import argparse
import json
import subprocess
import sys
import time

import pytest

from bench import serve_bench
from bench.common import Request
from bench.serve_bench import Measured, Round, Stream, percentile, read_stream

# recorded from `llama-server` (/v1/completions, 4 tokens, include_usage): a chunk per token, the second
# token special (empty text), then a chunk that only ends the stream and carries the usage
LLAMA = """\
data: {"choices":[{"text":"\\n","index":0,"logprobs":null,"finish_reason":null}],"object":"text_completion"}

data: {"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":null}],"object":"text_completion"}

data: {"choices":[{"text":"user","index":0,"logprobs":null,"finish_reason":null}],"object":"text_completion"}

data: {"choices":[{"text":"\\n","index":0,"logprobs":null,"finish_reason":null}],"object":"text_completion"}

data: {"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],"object":"text_completion","usage":{"completion_tokens":4,"prompt_tokens":7,"total_tokens":11},"timings":{"predicted_n":4}}

data: [DONE]

"""

# recorded from vLLM CPU 0.32.0 (same request): the last token's chunk carries the finish reason, the usage
# comes alone, with no choices
VLLM = """\
data: {"id":"cmpl-b6705799cb932a38","object":"text_completion","created":1796128437,"model":"smollm2","choices":[{"index":0,"text":"\\n","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}

data: {"id":"cmpl-b6705799cb932a38","object":"text_completion","created":1796128437,"model":"smollm2","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}

data: {"id":"cmpl-b6705799cb932a38","object":"text_completion","created":1796128437,"model":"smollm2","choices":[{"index":0,"text":"system","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}

data: {"id":"cmpl-b6705799cb932a38","object":"text_completion","created":1796128437,"model":"smollm2","choices":[{"index":0,"text":"\\n","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,"token_ids":null}]}

data: {"id":"cmpl-b6705799cb932a38","object":"text_completion","created":1796128437,"model":"smollm2","choices":[],"usage":{"prompt_tokens":7,"total_tokens":11,"completion_tokens":4},"system_fingerprint":"vllm-0.32.0-ba762983"}

data: [DONE]

"""

# pagedchat serve's shape: a chunk may carry several tokens (usage counts them), usage alone at the end
PAGEDCHAT = """\
data: {"id": "cmpl-0", "object": "text_completion", "created": 1, "model": "m", "choices": [{"index": 0, "logprobs": null, "finish_reason": null, "text": "The"}]}

data: {"id": "cmpl-0", "object": "text_completion", "created": 1, "model": "m", "choices": [{"index": 0, "logprobs": null, "finish_reason": "length", "text": " capital of"}]}

data: {"id": "cmpl-0", "object": "text_completion", "created": 1, "model": "m", "choices": [], "usage": {"prompt_tokens": 38, "completion_tokens": 3, "total_tokens": 41}}

data: [DONE]

"""


def ticking(start: float = 0.0, step: float = 0.1):
    t = [start]

    def clock():
        t[0] += step
        return t[0]

    return clock


@pytest.mark.parametrize("text, tokens, chunks", [(LLAMA, 4, 4), (VLLM, 4, 4), (PAGEDCHAT, 3, 2)],
                         ids=["llama.cpp", "vLLM", "pagedchat"])
def test_each_servers_stream_counts_its_tokens(text, tokens, chunks):
    stream = read_stream(text.splitlines(), sent=0.0, clock=ticking())
    assert stream.tokens == tokens and stream.chunks == chunks
    assert stream.ttft == pytest.approx(0.1)  # the first event is the first token


def test_without_usage_the_token_chunks_count_and_the_closing_chunk_does_not():
    lines = [line for line in LLAMA.splitlines() if "usage" not in line]
    lines.append('data: {"choices":[{"text":"","index":0,"finish_reason":"length"}]}')
    stream = read_stream(lines)
    assert stream.usage is None and stream.tokens == 4


def test_ttft_waits_for_a_chunk_with_a_token():
    lines = [": keep-alive", "", 'data: {"choices":[],"usage":null}', 'data: {"choices":[{"text":"a"}]}']
    stream = read_stream(lines, sent=1.0, clock=ticking(1.0, 0.25))
    assert stream.ttft == pytest.approx(0.5) and stream.tokens == 1  # the clock ticks per event


def test_an_error_event_fails_the_stream():
    with pytest.raises(serve_bench.PeerError, match="engine died"):
        read_stream(['data: {"error": {"message": "engine died", "code": 500}}'])


def test_sse_lines():
    assert serve_bench.parse_sse_line("data: [DONE]") is None
    assert serve_bench.parse_sse_line("event: ping") is None
    assert serve_bench.parse_sse_line('data:{"a": 1}') == {"a": 1}


def test_percentiles_interpolate_between_ranks():
    values = [40.0, 10.0, 30.0, 20.0]
    assert percentile(values, 50) == pytest.approx(25.0)
    assert percentile(values, 95) == pytest.approx(38.5)
    assert percentile([7.0], 95) == 7.0
    assert percentile(list(range(1, 101)), 95) == pytest.approx(95.05)


def test_a_round_counts_tokens_over_first_send_to_last_chunk():
    a = Stream(sent=0.0, first=0.5, done=2.0, usage=64)
    b = Stream(sent=0.1, first=1.0, done=4.0, usage=64)
    done = Round([a, b], client_cpu_s=0.2)
    assert done.wall == pytest.approx(4.0) and done.tok_s == pytest.approx(32.0)
    other = Round([Stream(0.0, 0.2, 1.0, usage=64), Stream(0.0, 0.3, 1.0, usage=64)], client_cpu_s=0.3)
    m = Measured.of([done, other])
    assert m.tok_s == pytest.approx(128.0)  # the best round
    assert m.rounds_tok_s == pytest.approx([32.0, 128.0]) and m.client_cpu == pytest.approx(0.5 / 5.0)
    assert sorted(m.ttft_ms) == pytest.approx([200.0, 300.0, 500.0, 900.0])  # every stream of every round
    assert m.p50 == pytest.approx(400.0)


def test_a_stream_short_of_max_tokens_fails_the_peer():
    requests = [Request([1, 2], 4)]
    serve_bench.check_counts("x", requests, [Stream(0.0, 0.1, 1.0, usage=4)])
    with pytest.raises(serve_bench.PeerError, match="3 tokens"):
        serve_bench.check_counts("x", requests, [Stream(0.0, 0.1, 1.0, usage=3)])


def test_the_request_body_is_greedy_streamed_token_ids():
    body = serve_bench.body(Request([5, 6, 7], 32), "m")
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 32
    assert body["temperature"] == 0 and body["ignore_eos"] and body["stream"]
    assert body["stream_options"] == {"include_usage": True}
    json.dumps(body)


def test_every_server_binds_loopback_with_the_slots_and_no_prefix_caching(monkeypatch):
    monkeypatch.setattr(serve_bench.peers, "llama_ready", lambda: True)
    monkeypatch.setattr(serve_bench.peers, "vllm_ready", lambda: True)
    monkeypatch.setattr(serve_bench.peers, "gguf_path", lambda t: f"/m.{t}.gguf")
    from pagedchat.engine.loading import loader
    monkeypatch.setattr(loader, "resolve_model", lambda m, progress=True: "/model")
    s = serve_bench.Settings("bfloat16", 2, 16, 8192)
    for peer in serve_bench.PEERS:
        command, env = serve_bench.server_command(peer, 1234, s)
        line = " ".join(command)
        assert "--port 1234" in line and ("--host 127.0.0.1" in line), line
        assert "16" in command
    llama, _ = serve_bench.server_command("llama", 1234, s)
    assert llama[llama.index("-m") + 1] == "/m.BF16.gguf" and llama[llama.index("-np") + 1] == "16"
    vllm, env = serve_bench.server_command("vllm", 1234, s)
    assert "--no-enable-prefix-caching" in vllm and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    ours, _ = serve_bench.server_command("pagedchat", 1234, s)
    assert ours[1] == "serve" and "--no-prefix-caching" in ours and ours[ours.index("--dtype") + 1] == "bfloat16"


def test_stop_ends_the_whole_process_group_and_its_cpu_is_counted():
    spin = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'while True: pass']); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", spin], start_new_session=True)
    try:
        # the spinning child, in the leader's group, is counted (on a busy machine it may take a while)
        assert until(lambda: serve_bench.group_cpu_s(process.pid) > 0.1)
    finally:
        serve_bench.stop(process, timeout=5)
    assert process.returncode is not None
    assert until(lambda: serve_bench.group_cpu_s(process.pid) == 0)  # nothing of the group left


def until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def fake_results(tok_s: dict[str, list[float]]) -> dict[str, dict]:
    return {peer: {"measured": {n: Measured(v, [100.0 * (i + 1), 200.0 * (i + 1)], [v * 0.9, v], 0.04, 1.5)
                                for n, v in zip((1, 16), values)}}
            for i, (peer, values) in enumerate(tok_s.items())}


def test_the_paired_ratio_is_the_median_of_back_to_back_rounds():
    assert serve_bench.paired_ratio([10.0, 20.0, 30.0], [10.0, 10.0, 40.0]) == pytest.approx(1.0)


def test_the_report_rates_each_engine_against_the_best_peer():
    servers = fake_results({"pagedchat": [20.0, 150.0], "llama": [30.0, 120.0], "vllm": [10.0, 100.0]})
    servers["vllm"] = {"error": "PeerError: not built"}
    servers["pagedchat"]["generate"] = {1: [18.0, 21.0], 16: [140.0, 155.0]}
    servers["pagedchat"]["generate_cpu"] = {1: 0.98, 16: 1.9}
    args = argparse.Namespace(n=[1, 16], max_tokens=64, rounds=2, warmup_s=5.0, no_generate=False)
    workloads = {1: [Request([1] * 37, 64)], 16: [Request([1] * 38, 64)] * 16}
    sec = serve_bench.section(args, "- machine: test\n- versions: test\n", workloads, servers, 1.0)
    text = sec.markdown()
    serve, http = sec.tables
    assert serve.headers[:5] == ["N", "engine", "total tokens/s", "TTFT p50 ms", "TTFT p95 ms"]
    assert len(serve.rows) == 2 * 3 and all(len(r) == len(serve.headers) for r in serve.rows)
    row = {(r[0], r[1]): r for r in serve.rows}
    assert row[(16, "pagedchat serve")][5] == pytest.approx(150 / 120)  # vs llama.cpp, the only peer measured
    assert row[(1, "pagedchat serve")][5] == pytest.approx(20 / 30)
    assert row[(16, "vLLM CPU")][2] == "n/a"
    assert row[(16, "llama.cpp")][6] == pytest.approx(1.0) and row[(16, "pagedchat serve")][6] == pytest.approx(0.5)
    # best / best, then the median of the paired rounds: (135 / 140 + 150 / 155) / 2
    assert [r[3] for r in http.rows] == pytest.approx([20 / 21, 150 / 155])
    assert http.rows[1][4] == pytest.approx((135 / 140 + 150 / 155) / 2) and http.rows[1][5:] == ["190%", "150%", "met"]
    assert all(len(r) == len(http.headers) for r in http.rows)
    assert "at N = 16, pagedchat serve at least matches the best peer's total tokens/s" in text
    assert "1.25x -> met" in text and "serve / generate >= 0.95x: 0.97x -> met" in text
    assert "not measured: vLLM CPU: PeerError: not built" in text
    assert "- machine: test" in text and "| 16 | pagedchat serve | 150 |" in text and "| 150% | 4% |" in text
