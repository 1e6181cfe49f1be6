"""Throughput: `LLM.generate` against HF `generate` (static batches of 8, stock and GQA-folded) and
against transformers' continuous batching, on the same requests, in one process.

    python -m bench.throughput [--dtype bfloat16 float32] [--full] [--issue2]

Two workloads: issue 6's chat-like mix (32 requests, prompts 16..512, outputs 16..256 with --full;
scaled down by default so it ends in minutes on 2 busy cores) and issue 2's 16 chat prompts x 64 new
tokens. Every request generates exactly its output length (EOS ignored), so every peer does the same
useful work; a static batch still runs until its longest member is done, which is its waste.
"""

import math
from collections.abc import Sequence

import torch

from bench import hf_peers
from bench.common import (
    DTYPES, Request, Section, Table, arg_parser, describe, start, layer_shapes, load_hf, load_llm,
    Times, flops_per_token, matmul_gflops, model_config, random_requests, stopwatch,
)
import torch.nn.functional as F

from pagedchat.engine.layers.linear import linear_for, widens_matmuls

# (requests, prompt length range, output length range) per size; the full size is issue 6's.
MIX_SIZES = {
    "full": (32, (16, 512), (16, 256)),
    "default": (12, (16, 192), (8, 64)),
    "quick": (8, (16, 96), (8, 32)),
    "smoke": (3, (4, 12), (2, 4)),
}
ISSUE2_SIZES = {"full": 64, "default": 24, "quick": 8, "smoke": 3}  # new tokens for each of 16 prompts
STATIC_BATCH = 8
BLOCK_SIZE = 16
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about autumn.", "Explain recursion to a child.",
    "Give me three tips for better sleep.", "What is a prime number?", "Summarise the plot of Hamlet.",
    "How do I boil an egg?", "Why is the sky blue?", "Name five fruits that are red.",
    "What does a CPU cache do?", "Translate 'good morning' into Spanish.", "Tell me a joke about cats.",
    "How far is the Moon from the Earth?", "What is photosynthesis?", "Suggest a name for a puppy.",
    "What is the difference between weather and climate?",
]

PEERS = ("pagedchat", "HF generate, static batch 8", "HF generate, GQA folded", "transformers generate_batch")


def chat_requests(tokenizer, output_len: int) -> list[Request]:
    """Issue 2's workload: 16 single-question chats (the model's template) x output_len new tokens."""
    return [
        Request(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False), output_len)
        for q in QUESTIONS
    ]


def pool_blocks(requests: Sequence[Request]) -> int:
    """Blocks for every request at full length at once: throughput is measured without preemption."""
    return sum(math.ceil((len(r.prompt) + r.output_len) / BLOCK_SIZE) for r in requests) + len(requests)


def run_engine(llm, requests: Sequence[Request]) -> Times:
    from pagedchat import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    with stopwatch() as t:
        outs = llm.generate([r.prompt for r in requests], params)
    assert [len(o.token_ids) for o in outs] == [r.output_len for r in requests], "wrong output lengths"
    return t


def measure(model: str | None, dtype: str, requests: Sequence[Request],
            repeats: int = 1) -> tuple[dict[str, Times], tuple[int, int]]:
    """Each peer's best run (least CPU time) over `repeats` rounds, peers interleaved; the model's FLOPs."""
    num_blocks = pool_blocks(requests)
    llm = load_llm(model, dtype, num_kv_blocks=num_blocks, block_size=BLOCK_SIZE)
    hf = load_hf(llm.model_path, dtype)
    warm = requests[:2]
    run_engine(llm, warm)  # first calls allocate; keep them out of every peer's time
    hf_peers.hf_static(hf, warm)

    def static(attn: str) -> Times:
        hf.set_attn_implementation(attn)
        return hf_peers.hf_static(hf, requests, STATIC_BATCH)

    def continuous() -> Times:
        hf.set_attn_implementation("sdpa")
        return hf_peers.hf_continuous(hf, requests, num_blocks, BLOCK_SIZE)

    runs = dict(zip(PEERS, (lambda: run_engine(llm, requests), lambda: static("sdpa"),
                            lambda: static(hf_peers.FOLDED_SDPA), continuous)))
    best: dict[str, Times] = {}
    for _ in range(repeats):
        for name, fn in runs.items():
            t = fn()
            if name not in best or t.cpu < best[name].cpu:
                best[name] = t
    return best, flops_per_token(hf)


def report(title: str, dtype: str, requests: Sequence[Request], times: dict[str, Times], flops: tuple[int, int],
           goals: dict[str, float], ceiling: dict[str, float], scaled: str = "") -> Section:
    generated = sum(r.output_len for r in requests)
    prompt = sum(len(r.prompt) for r in requests)
    ours = times["pagedchat"]
    rows = []
    for name in PEERS:
        t = times[name]
        ratio = t.cpu / ours.cpu
        target = goals.get(name)
        rows.append([name, t.cpu, t.wall, generated / t.cpu, ratio, t.wall / ours.wall,
                     f">= {target:g}x: {'met' if ratio >= target else 'MISSED'}" if target else ""])
    # The ceiling: the time the matmuls alone would need at the machine's measured GFLOP/s (decode
    # tokens at the decode batch's rate, prompt tokens at a large batch's rate), 2 x params FLOPs per
    # token, the vocabulary projection only for sampled tokens (nobody computes it for prompt tokens).
    body, head = flops
    decode_flops, prompt_flops = generated * (body + head), prompt * body
    ideal = (decode_flops / ceiling["decode"] + prompt_flops / ceiling["prefill"]) / 1e9
    section = Section(
        title,
        settings=[f"workload: {describe(requests)}{scaled}", f"dtype {dtype}, greedy, EOS ignored; "
                  f"static batches of {STATIC_BATCH} left-padded in arrival order; KV pool {pool_blocks(requests)} "
                  f"blocks of {BLOCK_SIZE} for pagedchat and generate_batch (all requests fit: no preemption)",
                  "ratios on CPU time (one torch thread: the work done, which other jobs on the shared cores "
                  "do not stretch as they stretch wall time); wall-time ratios beside them"],
        tables=[Table(["peer", "CPU s", "wall s", "generated tok / CPU s", "its time / pagedchat's (CPU)",
                       "(wall)", "goal"], rows)],
    )
    if ceiling["widened"]:
        section.notes.append(f"pagedchat multiplies {dtype} batches in fp32 through oneDNN on this CPU, which has no "
                             "bf16 instructions (pagedchat/engine/cpu_linear.py); the HF peers use "
                             f"torch's own {dtype} matmuls. The ceiling is the faster of the two routes.")
    section.notes.append(
        f"compute ceiling: linear layers of one layer's weight shapes, best of 5 trials (CPU time with one thread): "
        f"{ceiling['decode']:.1f} GFLOP/s "
        f"at B = {ceiling['decode_rows']} (the decode batch), {ceiling['prefill']:.1f} GFLOP/s at B = 512 (prompts); "
        f"2 x params FLOPs per token ({body / 2e6:.0f}M in the layers, {head / 2e6:.0f}M in the LM head, only for "
        f"sampled tokens) -> matmuls alone would take {ideal:.1f} s: pagedchat reaches {ideal / ours.cpu:.0%} of the "
        f"ceiling ({(decode_flops + prompt_flops) / ours.cpu / 1e9:.1f} GFLOP/s per CPU second)")
    section.chart = {f"{dtype}: {name}": (times[name].cpu / ours.cpu, goals.get(name)) for name in PEERS[1:]}
    return section


def ceiling_for(model: str | None, dtype: str, decode_rows: int) -> dict[str, float]:
    """Matmul GFLOP/s of one of the model's layers at the decode batch and at a prompt-sized batch."""
    shapes = layer_shapes(model_config(model))
    widened = widens_matmuls(DTYPES[dtype], torch.device("cpu"))

    def rate(rows: int) -> float:  # torch's own product or pagedchat's route (cpu_linear), the faster
        routes = (F.linear, linear_for(DTYPES[dtype], torch.device("cpu")))
        return max(matmul_gflops(DTYPES[dtype], rows, shapes, linear=route) for route in routes)

    return {"decode": rate(decode_rows), "prefill": rate(512), "decode_rows": decode_rows, "widened": widened}


def mix_section(model: str | None, dtype: str, size: str, repeats: int = 1) -> Section:
    n, prompts, outputs = MIX_SIZES[size]
    requests = random_requests(n, prompts, outputs, seed=0, vocab=model_config(model).vocab_size)
    with stopwatch() as t:
        times, flops = measure(model, dtype, requests, repeats)
        ceiling = ceiling_for(model, dtype, min(n, 64))
    scaled = "" if size == "full" else " (scaled down from issue 6's 32 x 16..512 / 16..256: `--size full`)"
    goals = {PEERS[1]: 2.0, PEERS[3]: 2.0, PEERS[2]: 1.5}
    section = report(f"1. Throughput, chat-like mix ({dtype})", dtype, requests, times, flops, goals, ceiling,
                     scaled)
    section.seconds = t.wall
    return section


def issue2_section(model: str | None, dtype: str, size: str, repeats: int = 1) -> Section:
    from transformers import AutoTokenizer

    from pagedchat.engine.loading import loader

    tokenizer = AutoTokenizer.from_pretrained(loader.metadata_folder(loader.resolve_model(model)))
    new_tokens = ISSUE2_SIZES[size]
    requests = chat_requests(tokenizer, new_tokens)[: 3 if size == "smoke" else None]
    with stopwatch() as t:
        times, flops = measure(model, dtype, requests, repeats)
        ceiling = ceiling_for(model, dtype, len(requests))
    scaled = "" if new_tokens == 64 else " (scaled down from issue 2's 64 new tokens: `--size full`)"
    section = report(f"Issue 2: 16 chat prompts x {new_tokens} new tokens ({dtype})", dtype, requests, times, flops,
                     {}, ceiling, scaled)
    section.chart = {}
    section.seconds = t.wall
    return section


def main() -> None:
    parser = arg_parser(__doc__, ["bfloat16", "float32"])
    parser.add_argument("--size", choices=tuple(MIX_SIZES), default="default")
    parser.add_argument("--repeats", type=int, default=1)
    args = start(parser)
    for dtype in args.dtype:
        print(mix_section(args.model, dtype, args.size, args.repeats).markdown())
        print(issue2_section(args.model, dtype, args.size, args.repeats).markdown())


if __name__ == "__main__":
    main()
