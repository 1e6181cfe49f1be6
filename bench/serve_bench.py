"""Serving: N concurrent streaming clients against `pagedchat serve`, llama.cpp's `llama-server` and
vLLM CPU's OpenAI server, on the default model at one precision for all (issue 15).

    python -m bench.peers setup                        # once: llama.cpp and vLLM CPU in their own venvs
    python -m bench.serve_bench                        # N = 1, 4, 16; 128 tokens each; bf16
    python -m bench.serve_bench --peers llama vllm --n 1 4 --max-tokens 32 --rounds 1
    python -m bench.serve_bench --results bench/RESULTS.md   # and append the section there

Every server runs as its own subprocess on 127.0.0.1 at a free port, with as many slots / sequences as
the largest N; they are started one after another, each waited for (`/health`), then all warmed up, and
at the end (also on errors) stopped: SIGTERM to each one's process group, SIGKILL after a timeout. The
rounds take turns, one engine at a time, the order rotating from round to round: on a machine shared
with other jobs, whose load drifts over minutes, each engine gets a share of every stretch. Each round
starts once the machine is quiet (under a quarter of a core busy for a quarter second, at most 10 s):
vLLM's server keeps a core busy for about a second after its last stream, which would otherwise fall on
the round after its own. The clients are httpx tasks in one event loop (uvloop's where installed), all
released at once: each POSTs `/v1/completions` with the same prompt token ids (bench/throughput.py's 16
chat prompts, cycled for N > 16), `max_tokens` fixed, greedy, EOS ignored, `stream: true` with
`stream_options.include_usage`; a stream's tokens are its `usage.completion_tokens` (else its token
chunks) and must equal `max_tokens`.
Prefix caching is off everywhere, so every engine prefills every prompt token.

- total tokens/s: all generated tokens / (last chunk received - first request sent), best of the rounds;
- TTFT: send to the first chunk that carries a token, p50 / p95 over the streams of all rounds;
- the HTTP layer: the same requests through pagedchat's `LLM.generate` in this process, taking its turn
  among the rounds: the median over the cycles of serve's tokens/s / generate's.
"""

import argparse
import asyncio
import gc
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import peer_bench, peers
from bench.common import Request, Section, Table, goal, header, load_average, load_llm

PEERS = ("pagedchat", "llama", "vllm")
LABELS = {"pagedchat": "pagedchat serve", "llama": "llama.cpp", "vllm": "vLLM CPU"}
GOAL_N = 16  # the N of the goal lines
TOKENS_GOAL = 1.0  # pagedchat serve's total tokens/s over the best peer's, at GOAL_N
HTTP_GOAL = 0.95  # pagedchat serve's tokens/s over LLM.generate's on the same requests


class PeerError(Exception):
    """A server that did not start, answered wrongly or streamed the wrong number of tokens."""


# ---- the statistics ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass
class Stream:
    """One client's stream: when it was sent, its first token chunk arrived, its last byte arrived."""

    sent: float
    first: float | None = None
    done: float | None = None
    chunks: int = 0  # chunks that carry a token
    usage: int | None = None  # completion_tokens of the usage chunk, where the server sent one

    @property
    def tokens(self) -> int:
        return self.usage if self.usage is not None else self.chunks

    @property
    def ttft(self) -> float:
        return (self.first if self.first is not None else float("nan")) - self.sent

    def add(self, event: dict, now: float) -> None:
        """Count one SSE event (a completion chunk, OpenAI format)."""
        if event.get("error"):
            error = event["error"]
            raise PeerError(f"error event: {error.get('message', error) if isinstance(error, dict) else error}")
        if event.get("usage"):
            self.usage = event["usage"]["completion_tokens"]
        for choice in event.get("choices") or []:
            # a chunk that only says why the stream ended (llama.cpp's last one) carries no token
            if choice.get("finish_reason") and not choice.get("text"):
                continue
            self.chunks += 1
            if self.first is None:
                self.first = now


def parse_sse_line(line: str) -> dict | None:
    """The JSON of one `data: ...` line of a server-sent event stream; None for anything else (blank
    lines, comments, other fields, the closing `[DONE]`)."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


def read_stream(lines: Iterable[str], sent: float = 0.0, clock=None) -> Stream:
    """A Stream from recorded SSE text (the same parsing as the live client)."""
    stream = Stream(sent)
    for line in lines:
        if (event := parse_sse_line(line)) is not None:
            stream.add(event, clock() if clock else 0.0)
    return stream


@dataclass
class Round:
    streams: list[Stream]
    client_cpu_s: float = 0.0  # this process's CPU seconds over the round: what the clients took of the cores
    server_cpu_s: float = 0.0  # the server's process group's CPU seconds over the round

    @property
    def wall(self) -> float:
        return max(s.done for s in self.streams) - min(s.sent for s in self.streams)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def tok_s(self) -> float:
        return self.tokens / max(self.wall, 1e-9)


@dataclass
class Measured:
    """One engine at one N: tokens/s is the best round's, TTFT over every stream of every round."""

    tok_s: float
    ttft_ms: list[float] = field(default_factory=list)
    rounds_tok_s: list[float] = field(default_factory=list)  # in order, each round's
    client_cpu: float = float("nan")  # the clients' CPU seconds over the rounds' wall seconds
    server_cpu: float = float("nan")  # the server's CPU seconds over the rounds' wall seconds

    @property
    def p50(self) -> float:
        return percentile(self.ttft_ms, 50)

    @property
    def p95(self) -> float:
        return percentile(self.ttft_ms, 95)

    @classmethod
    def of(cls, rounds: Sequence[Round]) -> "Measured":
        return cls(max(r.tok_s for r in rounds), [s.ttft * 1e3 for r in rounds for s in r.streams],
                   [r.tok_s for r in rounds], sum(r.client_cpu_s for r in rounds) / sum(r.wall for r in rounds),
                   sum(r.server_cpu_s for r in rounds) / sum(r.wall for r in rounds))


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """The median over rounds of ours / theirs, each pair measured in the same cycle of turns (drift in the
    machine's other load mostly cancels within a pair)."""
    return percentile([a / b for a, b in zip(ours, theirs)], 50)


# ---- the workload -----------------------------------------------------------------------------------


def workload(tokenizer, n: int, max_tokens: int) -> list[Request]:
    """n chat prompts (the 16 of bench/throughput.py, cycled), each generating max_tokens."""
    from bench.throughput import chat_requests

    chats = chat_requests(tokenizer, max_tokens)
    return [chats[i % len(chats)] for i in range(n)]


def body(request: Request, model: str) -> dict:
    return {"model": model, "prompt": request.prompt, "max_tokens": request.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "cache_prompt": False}  # llama.cpp's own prefix reuse off, like the others' prefix caching


def check_counts(name: str, requests: Sequence[Request], streams: Sequence[Stream]) -> None:
    for request, stream in zip(requests, streams):
        if stream.tokens != request.output_len or stream.first is None:
            raise PeerError(f"{name} streamed {stream.tokens} tokens ({stream.chunks} token chunks) "
                            f"for max_tokens {request.output_len}")


# ---- the clients ------------------------------------------------------------------------------------


async def stream_one(client, url: str, payload: dict, go: asyncio.Event) -> Stream:
    await go.wait()
    stream = Stream(time.perf_counter())
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:300]
            raise PeerError(f"HTTP {response.status_code} from {url}: {text}")
        async for line in response.aiter_lines():
            if (event := parse_sse_line(line)) is not None:
                stream.add(event, time.perf_counter())
    stream.done = time.perf_counter()
    return stream


async def one_round(client, url: str, model: str, requests: Sequence[Request]) -> Round:
    """Every request at once: the tasks wait on one event, set when all of them are waiting."""
    go = asyncio.Event()
    tasks = [asyncio.create_task(stream_one(client, url, body(r, model), go)) for r in requests]
    await asyncio.sleep(0)
    cpu = time.process_time()
    go.set()
    streams = list(await asyncio.gather(*tasks))
    return Round(streams, time.process_time() - cpu)


async def served_model(client, base: str) -> str:
    """The name to send as `model`: the first the server lists (vLLM checks it)."""
    try:
        response = await client.get(base + "/v1/models")
        return response.json()["data"][0]["id"]
    except Exception:  # noqa: BLE001 - a server without the list takes any name
        return "default"


async def warm_up(client, server: "Server", workloads: dict[int, list[Request]], warmup_s: float) -> None:
    """One chat alone for warmup_s (pagedchat compiles its one-chat step meanwhile), then the widest batch."""
    server.model = await served_model(client, server.base)
    biggest = max(workloads)
    one = [Request(workloads[biggest][0].prompt, 16)]
    started = time.perf_counter()
    while True:
        check_counts(server.name, one, (await one_round(client, server.url, server.model, one)).streams)
        if time.perf_counter() - started >= warmup_s:
            break
    wide = [Request(r.prompt, 4) for r in workloads[biggest]]
    check_counts(server.name, wide, (await one_round(client, server.url, server.model, wide)).streams)


async def compiled(client, server: "Server", timeout_s: float = 900) -> None:
    """Wait out a compile of pagedchat's one-chat step (`pagedchat:decode_compiling` in /metrics): the
    thread policy starts one for each thread count it comes to, and it must not run beside a round, as
    LLM.generate's does not (InProcess.measure)."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        text = (await client.get(server.base + "/metrics")).text
        if not any(line.startswith("pagedchat:decode_compiling{") and not line.endswith(" 0")
                   for line in text.splitlines()):
            return
        await asyncio.sleep(1)
    raise PeerError(f"{server.name} still compiles after {timeout_s:.0f} s")


def rotated(items: list, i: int) -> list:
    k = i % len(items) if items else 0
    return items[k:] + items[:k]


async def measure_all(servers: list["Server"], workloads: dict[int, list[Request]], rounds: int, warmup_s: float,
                      paired: "InProcess | None" = None) -> dict[str, dict]:
    """Warm up each server in turn; then at each N, `rounds` rounds of every server and (with `paired`) of
    LLM.generate, taking turns, the order rotating from round to round: the machine's other load drifts over
    minutes, and so each engine gets a share of every stretch of it. A server that fails drops out."""
    import httpx

    results: dict[str, dict] = {srv.peer: {"load_s": srv.load_s, "measured": {}} for srv in servers}
    live: list[Server] = []

    def failed(srv: "Server", error: Exception) -> None:
        kept = {k: v for k, v in results[srv.peer].items() if k == "generate_error"}
        results[srv.peer] = {**kept, "error": f"{type(error).__name__}: {error}"}
        print(f"  {srv.name}: {results[srv.peer]['error']}", flush=True)
        if srv in live:
            live.remove(srv)

    # a connection per request: llama-server may close a kept-alive one just as the next request goes out
    limits = httpx.Limits(max_connections=max(workloads) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800, connect=30), limits=limits) as client:
        for srv in servers:
            try:
                await warm_up(client, srv, workloads, warmup_s)
                live.append(srv)
            except Exception as error:  # noqa: BLE001 - one peer's failure is reported, the others still run
                failed(srv, error)
        for n, requests in workloads.items():
            done: dict[str, list[Round]] = {srv.peer: [] for srv in live}
            for i in range(rounds):
                for srv in rotated(list(live) + ([None] if paired else []), i):
                    peer_bench.wait_until_quiet(limit_s=10.0, interval_s=0.25)
                    if srv is None:
                        try:
                            paired.measure(n, requests)
                        except Exception as error:  # noqa: BLE001 - the servers go on
                            results.setdefault("pagedchat", {})["generate_error"] = f"{type(error).__name__}: {error}"
                            paired = None
                        continue
                    try:
                        if srv.peer == "pagedchat":
                            await compiled(client, srv)
                        cpu = group_cpu_s(srv.process.pid)
                        got = await one_round(client, srv.url, srv.model, requests)
                        got.server_cpu_s = group_cpu_s(srv.process.pid) - cpu
                        check_counts(srv.name, requests, got.streams)
                        done[srv.peer].append(got)
                    except Exception as error:  # noqa: BLE001
                        failed(srv, error)
            for srv in live:
                m = results[srv.peer]["measured"][n] = Measured.of(done[srv.peer])
                print(f"  {srv.name} N={n}: {m.tok_s:.1f} tok/s, TTFT p50 {m.p50:.0f} ms, p95 {m.p95:.0f} ms, "
                      f"server CPU {m.server_cpu:.0%}, clients' CPU {m.client_cpu:.0%}", flush=True)
            if paired is not None:
                print(f"  LLM.generate N={n}: {max(paired.results[n]):.1f} tok/s", flush=True)
    return results


# ---- the servers ------------------------------------------------------------------------------------


@dataclass
class Settings:
    dtype: str
    threads: int
    slots: int  # llama.cpp's slots, vLLM's and pagedchat's max sequences: the largest N
    kv_tokens: int  # the KV budget of pagedchat and llama.cpp
    max_model_len: int = 2048


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of a process group (a server and its children)."""
    ticks = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # after the name: state, ppid, pgrp; utime, stime at 11, 12
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def client_event_loop() -> str:
    """uvloop where it is installed (the serve extra brings it): the clients share the cores with the server
    they measure, and httpx took ~30% less CPU a chunk on uvloop than on asyncio's own loop."""
    return "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"


def run_clients(main: Coroutine):
    if client_event_loop() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(peer: str, port: int, s: Settings) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of one peer's server on 127.0.0.1:port."""
    if peer == "pagedchat":
        command = [str(Path(sys.executable).parent / "pagedchat"), "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--device", "cpu", "--dtype", s.dtype, "--max-num-seqs", str(s.slots), "--num-blocks", str(s.kv_tokens // 16), "--no-prefix-caching"]
        return command, {}
    if peer == "llama":
        if not peers.llama_ready():
            raise PeerError("not built (python -m bench.peers setup)")
        command = [str(peers.llama_binary("llama-server")), "-m", str(peers.gguf_path(peer_bench.GGUF_TYPES[s.dtype])),
                   "-t", str(s.threads), "-c", str(s.kv_tokens), "-np", str(s.slots), "--host", "127.0.0.1",
                   "--port", str(port), "--no-webui"]
        return command, {}
    if peer == "vllm":
        if not peers.vllm_ready():
            raise PeerError("not built (python -m bench.peers setup)")
        command = peers.vllm_server_command(
            "--model", str(peers.default_model_folder()), "--dtype", s.dtype,
            "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.slots), "--seed", "0",
            "--no-enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port),
            "--disable-uvicorn-access-log", "--disable-log-stats")
        bind = f"0-{s.threads - 1}" if s.threads > 1 else "0"
        return command, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": bind}
    raise ValueError(peer)


def log_tail(path: Path, lines: int = 5) -> str:
    try:
        return " / ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def wait_healthy(base: str, process: subprocess.Popen, log: Path, timeout: float) -> float:
    """Seconds until GET /health answers 200 (a 503 means still loading); PeerError if the server
    exits or the time runs out."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if process.poll() is not None:
            raise PeerError(f"exited with {process.returncode} before it was healthy: {log_tail(log)}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return time.perf_counter() - started
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise PeerError(f"not healthy after {timeout:.0f} s: {log_tail(log)}")


def stop(process: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM to the server's process group (vLLM's engine runs in a child), SIGKILL after `timeout`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # the leader is gone: kill what it may have left in its group
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


@dataclass
class Server:
    """A peer's server, started and healthy."""

    peer: str
    process: subprocess.Popen
    base: str
    log: Path
    load_s: float = 0.0
    model: str = "default"

    @property
    def name(self) -> str:
        return LABELS[self.peer]

    @property
    def url(self) -> str:
        return self.base + "/v1/completions"


def start_server(peer: str, s: Settings, start_timeout: float) -> Server:
    """The peer's server on a free port of 127.0.0.1, once /health says it is ready (PeerError if not)."""
    port = free_port()
    command, env = server_command(peer, port, s)
    log = Path(tempfile.mkstemp(prefix=f"serve-bench-{peer}-", suffix=".log")[1])
    print(f"{LABELS[peer]}: {' '.join(command)} (log {log})", flush=True)
    with open(log, "w") as out:
        # vLLM away from this checkout, whose kernels/ would shadow the `kernels` package vLLM imports
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, **env}, cwd=tempfile.gettempdir(), start_new_session=True)
    server = Server(peer, process, f"http://127.0.0.1:{port}", log)
    try:
        server.load_s = wait_healthy(server.base, process, log, start_timeout)
    except BaseException:
        stop_server(server)
        raise
    return server


def stop_server(server: Server) -> None:
    stop(server.process)
    if server.process.returncode not in (None, 0, -signal.SIGTERM, -signal.SIGKILL):
        print(f"  {server.name} exited with {server.process.returncode}: {log_tail(server.log)}", flush=True)


class InProcess:
    """The same requests through pagedchat's `LLM.generate` in this process, set up like the server (same
    KV pool, max sequences, no prefix caching, the engine's own thread policy); loaded, compiled and warmed
    up before the server starts, then idle while the server's rounds run."""

    def __init__(self, s: Settings, workloads: dict[int, list[Request]], warmup_s: float):
        self.llm = load_llm(None, s.dtype, num_threads=None, num_kv_blocks=s.kv_tokens // 16, max_num_seqs=s.slots,
                            enable_prefix_caching=False)
        self.results: dict[int, list[float]] = {n: [] for n in workloads}
        self.cpu: dict[int, tuple[float, float]] = {n: (0.0, 0.0) for n in workloads}  # CPU s, wall s of the rounds
        self.cpu_s = 0.0
        self.wait_compiled()
        biggest = max(workloads)
        started = time.perf_counter()
        while True:  # as the servers are warmed up
            self.run([Request(workloads[biggest][0].prompt, 16)])
            if time.perf_counter() - started >= warmup_s:
                break
        self.run([Request(r.prompt, 4) for r in workloads[biggest]])

    def wait_compiled(self) -> None:
        if self.llm.engine.runner.compiled is not None:
            self.llm.engine.runner.compiled.wait(timeout=900)

    def run(self, requests: Sequence[Request]) -> float:
        from pagedchat import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        start, cpu = time.perf_counter(), time.process_time()
        outputs = self.llm.generate([r.prompt for r in requests], params)
        wall, self.cpu_s = time.perf_counter() - start, time.process_time() - cpu
        counts = [len(o.token_ids) for o in outputs]
        if counts != [r.output_len for r in requests]:
            raise PeerError(f"LLM.generate made {counts} tokens")
        return sum(counts) / wall

    def measure(self, n: int, requests: Sequence[Request]) -> None:
        start = time.perf_counter()
        self.results[n].append(self.run(requests))
        self.cpu[n] = (self.cpu[n][0] + self.cpu_s, self.cpu[n][1] + time.perf_counter() - start)
        self.wait_compiled()  # a compile the thread policy started must not run beside the server's round

    def close(self) -> None:
        self.wait_compiled()  # a compile thread still alive at exit aborts the interpreter
        del self.llm
        gc.collect()


# ---- the report -------------------------------------------------------------------------------------


def llama_version() -> str:
    try:
        done = subprocess.run([str(peers.llama_binary("llama-server")), "--version"], capture_output=True,
                              text=True, timeout=30)
        line = next(l for l in (done.stdout + done.stderr).splitlines() if l.startswith("version:"))
        return line.split(":", 1)[1].strip()
    except (OSError, StopIteration, subprocess.SubprocessError):
        return "unknown"


def ratio(a: float, b: float) -> object:
    return a / b if a == a and b == b and b else "n/a"  # NaN-safe


def serve_table(ns: Sequence[int], servers: dict[str, dict]) -> tuple[Table, dict[int, float | None]]:
    """A row per N and engine; ratios against the best peer (llama.cpp or vLLM) at that N: its
    tokens/s (highest) and TTFT p50 (lowest). Also pagedchat serve / best peer tokens/s per N."""
    rows, vs_best = [], {}
    for n in ns:
        got = {p: r["measured"][n] for p, r in servers.items() if "measured" in r}
        others = [m for p, m in got.items() if p != "pagedchat"]
        best_tok = max((m.tok_s for m in others), default=float("nan"))
        best_ttft = min((m.p50 for m in others), default=float("nan"))
        for peer in servers:
            if peer not in got:
                rows.append([n, LABELS[peer]] + ["n/a"] * 7)
                continue
            m = got[peer]
            rows.append([n, LABELS[peer], m.tok_s, m.p50, m.p95, ratio(m.tok_s, best_tok), ratio(m.p50, best_ttft),
                         f"{m.server_cpu:.0%}", f"{m.client_cpu:.0%}"])
        vs_best[n] = ratio(got["pagedchat"].tok_s, best_tok) if "pagedchat" in got and others else None
    headers = ["N", "engine", "total tokens/s", "TTFT p50 ms", "TTFT p95 ms", "tokens/s / best peer",
               "TTFT p50 / best peer", "server CPU (of a core)", "clients' CPU"]
    return Table(headers, rows, "N concurrent streaming clients (tokens/s: higher is better; TTFT: lower)"), vs_best


def http_table(ns: Sequence[int], serve: dict) -> tuple[Table, dict[int, object]]:
    """pagedchat serve against LLM.generate at each N: best of each, and the median ratio of the paired
    rounds (the goal's)."""
    rows, ratios = [], {}
    for n in ns:
        ours = serve["measured"][n] if "measured" in serve else None
        bare = serve.get("generate", {}).get(n)
        if ours is None or not bare:
            rows.append([n] + ["n/a"] * 6 + ["not measured"])
            continue
        ratios[n] = paired_ratio(ours.rounds_tok_s, bare)
        cpu = serve.get("generate_cpu", {}).get(n, float("nan"))
        rows.append([n, max(bare), ours.tok_s, ours.tok_s / max(bare), ratios[n], f"{cpu:.0%}",
                     f"{ours.server_cpu:.0%}", "met" if ratios[n] >= HTTP_GOAL else "MISSED"])
    headers = ["N", "LLM.generate tokens/s", "pagedchat serve tokens/s", "best / best",
               "serve / generate, paired rounds (median)", "generate CPU (of a core)", "serve CPU",
               f"goal >= {HTTP_GOAL:g}"]
    return Table(headers, rows, "the HTTP layer: the same requests through LLM.generate in-process, "
                                "its rounds taking turns with the servers'"), ratios


def machine_header(s: Settings) -> str:
    """bench/common.py's header (machine, load average now, versions) with the engines and settings."""
    return header({
        "engines": f"llama.cpp: llama-server {llama_version()} (vendored in {peers.LLAMA_CPP_PYTHON}, "
                   f"{peers.LLAMA_BUILD}); vLLM: {peers.VLLM_CPU}",
        "settings": f"{s.dtype} for all (llama.cpp on the {peer_bench.GGUF_TYPES[s.dtype]} GGUF made from the "
                    f"shipped Q4_1, the weights pagedchat loads); {s.threads} threads for llama.cpp and vLLM "
                    f"(VLLM_CPU_OMP_THREADS_BIND), pagedchat's own thread policy; {s.slots} slots / max sequences; "
                    f"KV budget {s.kv_tokens} tokens for pagedchat and llama.cpp (vLLM: VLLM_CPU_KVCACHE_SPACE=1 GiB); "
                    "prefix caching off everywhere",
    })


def section(args, machine: str, workloads: dict[int, list[Request]], servers: dict[str, dict],
            seconds: float) -> Section:
    prompts = [len(r.prompt) for r in workloads[max(workloads)]]
    sec = Section("Serving: N concurrent streaming clients, pagedchat serve against llama-server and vLLM CPU "
                  "(issue 15)")
    sec.settings = [line[2:] for line in machine.splitlines() if line.startswith("- ")]
    sec.settings += [
        f"load average at end: {load_average()}",
        f"workload: N streaming clients released at once (httpx, one {client_event_loop()} event loop in the bench process, on the same "
        f"cores) POST /v1/completions (a connection each): the 16 chat prompts of bench/throughput.py ({min(prompts)}..{max(prompts)} "
        f"tokens) as token ids, cycled for N > 16; max_tokens {args.max_tokens}, temperature 0, ignore_eos; "
        f"every stream checked to carry exactly max_tokens tokens; clients' CPU = this process's CPU seconds over "
        f"the rounds' wall seconds (on the cores the server uses; pagedchat's thread policy counts it as busy)",
        f"total tokens/s = generated tokens / (last chunk - first send), best of {args.rounds} rounds; TTFT = send to "
        f"the first token chunk, p50/p95 over the {args.rounds} x N streams; the engines' rounds take turns, the "
        f"order rotating, each round started once the machine is quiet (the rest under a quarter of a core over "
        f"0.25 s, at most 10 s); warm-up per engine: one chat for {args.warmup_s:g} s, then {max(workloads)} x 4 tokens",
        "server start to healthy: " + ", ".join(
            f"{LABELS[p]} {r['load_s']:.0f} s" for p, r in servers.items() if "load_s" in r),
    ]
    table, vs_best = serve_table(args.n, servers)
    sec.tables.append(table)
    goal_n = GOAL_N if GOAL_N in args.n else max(args.n)
    goal_line = f"at N = {goal_n}, pagedchat serve at least matches the best peer's total tokens/s"
    if isinstance(vs_best.get(goal_n), float):
        sec.notes.append(f"{goal_line}: " + goal("pagedchat serve / best peer", vs_best[goal_n], TOKENS_GOAL))
    else:
        sec.notes.append(f"{goal_line}: not measured")
    if "pagedchat" in servers and not args.no_generate:
        table, ratios = http_table(args.n, servers["pagedchat"])
        sec.tables.append(table)
        line = "the HTTP layer costs under 5% of tokens/s against the same load through LLM.generate"
        if isinstance(ratios.get(goal_n), float):
            sec.notes.append(f"{line}: at N = {goal_n}, " + goal("serve / generate", ratios[goal_n], HTTP_GOAL))
        else:
            sec.notes.append(f"{line}: not measured")
    errors = [(LABELS[p], r["error"]) for p, r in servers.items() if "error" in r]
    errors += [("LLM.generate", r["generate_error"]) for r in servers.values() if "generate_error" in r]
    sec.notes += [f"not measured: {name}: {error}" for name, error in errors]
    sec.seconds = seconds
    return sec


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    parser.add_argument("--n", nargs="+", type=int, default=[1, 4, 16], help="concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=list(peer_bench.GGUF_TYPES))
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's and vLLM's threads")
    parser.add_argument("--warmup-s", type=float, default=45.0,
                        help="seconds of one-chat warm-up per server (pagedchat compiles its one-chat step)")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a server to be healthy")
    parser.add_argument("--no-generate", action="store_true", help="skip the LLM.generate (HTTP layer) table")
    parser.add_argument("--results", type=Path, help="append the section to this Markdown file")
    args = parser.parse_args(argv)
    args.n = sorted(set(args.n))
    from transformers import AutoTokenizer

    from pagedchat.engine.loading import loader

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(loader.metadata_folder(loader.resolve_model(None, progress=False)))
    workloads = {n: workload(tokenizer, n, args.max_tokens) for n in args.n}
    longest = max(len(r.prompt) for r in workloads[max(args.n)]) + args.max_tokens
    kv_tokens = max(peer_bench.KV_TOKENS, max(args.n) * 16 * math.ceil(longest / 16 + 1))
    settings = Settings(args.dtype, args.threads, max(args.n), kv_tokens)
    machine = machine_header(settings)
    print(machine, flush=True)
    results, started_servers, paired = {}, [], None
    try:
        if "pagedchat" in args.peers and not args.no_generate:
            print("LLM.generate: loading, compiling and warming up in this process", flush=True)
            try:
                paired = InProcess(settings, workloads, args.warmup_s)
            except Exception as error:  # noqa: BLE001 - the server is still measured
                results["pagedchat"] = {"generate_error": f"{type(error).__name__}: {error}"}
        for peer in [p for p in PEERS if p in args.peers]:
            try:
                started_servers.append(start_server(peer, settings, args.start_timeout))
            except Exception as error:  # noqa: BLE001 - reported; the others still run
                results.setdefault(peer, {})["error"] = f"{type(error).__name__}: {error}"
                print(f"  {LABELS[peer]}: {results[peer]['error']}", flush=True)
        for peer, got in run_clients(measure_all(started_servers, workloads, args.rounds, args.warmup_s,
                                                 paired)).items():
            results[peer] = {**results.get(peer, {}), **got}
    finally:
        for server in started_servers:
            stop_server(server)
        if paired is not None:
            paired.close()
    if paired is not None and "pagedchat" in results:
        results["pagedchat"]["generate"] = paired.results
        results["pagedchat"]["generate_cpu"] = {n: cpu / wall if wall else float("nan")
                                                for n, (cpu, wall) in paired.cpu.items()}
    servers = {p: results[p] for p in PEERS if p in results}
    sec = section(args, machine, workloads, servers, time.perf_counter() - started)
    print(sec.markdown())
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n" + sec.markdown())


if __name__ == "__main__":
    main()
