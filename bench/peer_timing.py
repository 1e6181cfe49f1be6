"""How every engine of the peer benchmark is timed, on the same token ids: imported by pagedchat's own
worker and by the vLLM worker (which runs in vLLM's venv), so it needs nothing but the standard library.

An engine is a `generate(prompts, max_tokens) -> generated token counts` that returns when all are
done, greedy, EOS ignored. A job (JSON) names the workloads; the result (JSON) has, per workload:
- one chat: time to first token (a one-token generation, best of 3) and decode tokens per second,
  (128 - 1) tokens over the time a 128-token generation takes beyond its first token (best of `rounds`);
- many chats (16 x 64, the chat mix): generated tokens per wall second, best of `rounds`.
"""

import json
import sys
import time
from collections.abc import Callable

Generate = Callable[[list[list[int]], list[int]], list[int]]


def peak_rss_mb(pid: str = "self") -> float:
    """The process's peak resident memory (VmHWM), in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1e3
    return float("nan")


def one_chat(generate: Generate, prompt: list[int], new_tokens: int, rounds: int) -> dict[str, float]:
    first = []
    for _ in range(3):
        start = time.perf_counter()
        generate([prompt], [1])
        first.append(time.perf_counter() - start)
    ttft = min(first)
    whole = []
    for _ in range(rounds):
        start = time.perf_counter()
        counts = generate([prompt], [new_tokens])
        whole.append(time.perf_counter() - start)
        assert counts == [new_tokens], counts
    return {"ttft_ms": ttft * 1e3, "tok_s": (new_tokens - 1) / max(min(whole) - ttft, 1e-9)}


def many_chats(generate: Generate, prompts: list[list[int]], new_tokens: list[int], rounds: int) -> dict[str, float]:
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        counts = generate(prompts, new_tokens)
        wall = time.perf_counter() - start
        assert counts == new_tokens, counts
        best = max(best, sum(counts) / wall)
    return {"tok_s": best}


def run_job(job: dict, generate: Generate) -> dict:
    """Every workload of the job, in order; a short warm-up first."""
    generate(job["warmup"], [4] * len(job["warmup"]))
    results = {}
    for name, work in job["workloads"].items():
        if work["kind"] == "one_chat":
            results[name] = one_chat(generate, work["prompts"][0], work["new_tokens"][0], job["rounds"])
        else:
            results[name] = many_chats(generate, work["prompts"], work["new_tokens"], job["rounds"])
    return results


def read_job() -> dict:
    with open(sys.argv[1]) as f:
        return json.load(f)


def write_result(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)
