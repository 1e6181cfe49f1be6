"""An 8-bit KV cache against the 16-bit one on the default model (issue 33): what it buys and what it costs.

    python -m bench.kv_cache_bench              # its section goes into bench/RESULTS.md
    python -m bench.kv_cache_bench --quick      # smaller sizes, a smoke run (nothing written)

- blocks: the pool's blocks and bytes per block for one --kv-memory, each dtype;
- quality: greedy agreement (32 chat prompts x 128 new tokens, the tokens equal before the first divergence
  from the bf16 cache's, averaged) and teacher-forced perplexity on README.md (the project ships it), read
  through the cache in chunks of 128 tokens, so every chunk attends what the cache holds; llama.cpp's q8_0
  cache against its own f16 cache (`-fa on -ctk q8_0 -ctv q8_0`) on the same GGUF, where it is built;
- speed: decode tokens/s of one chat at a 4,000-token context and of 16 chats at 1,000 tokens each, each
  dtype in the same run (the prefill is not timed);
- pressure: the --demo pressure scene's six chats (greedy, 320 tokens each) in the bytes of 40 bf16 blocks:
  its preemptions with each dtype.

The default model computes in fp32 (a GGUF run in place), so `auto` is an fp32 cache; the 16-bit reference
is `--kv-cache-dtype bfloat16`.
"""

import argparse
import json
import math
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import torch

from bench import peer_bench, peers
from bench.common import Section, Table, header
from bench.peer_bench import write_into_results
from bench.throughput import QUESTIONS
from pagedchat import LLM, SamplingParams
from pagedchat.engine.chat import chat_prompt
from pagedchat.kernels import AttentionMetadata
from pagedchat.tui.demo import CONVERSATIONS, PROMPTS, SCENES

HERE = Path(__file__).resolve().parent
MARKS = ("<!-- kv cache: begin -->", "<!-- kv cache: end -->")
DTYPES = ("bfloat16", "int8", "fp8")
REFERENCE = "bfloat16"
PERPLEXITY_CHUNK = 128


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    questions = list(QUESTIONS) + [q for conversation in CONVERSATIONS for q in conversation]
    return [chat_prompt(tokenizer, [{"role": "user", "content": q}]) for q in (questions * 2)[:n]]


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """The tokens equal before the first divergence, averaged over the prompts."""
    def prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return sum(prefix(a, b) for a, b in zip(tokens, reference)) / len(reference)


def greedy(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


@torch.inference_mode()
def perplexity(llm: LLM, ids: list[int]) -> float:
    """exp(mean NLL) of each next token, the text fed in chunks through the runner straight into the pool's
    first blocks (a fresh engine, nothing else in it): a chunk reads the ones before it from the cache."""
    runner = llm.engine.runner
    size = runner.block_size
    table = list(range(math.ceil(len(ids) / size)))
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, PERPLEXITY_CHUNK):
        end = min(start + PERPLEXITY_CHUNK, len(ids))
        positions = list(range(start, end))
        metadata = AttentionMetadata.build([table[: math.ceil(end / size)]], [end], [end - start],
                                           [table[p // size] * size + p % size for p in positions])
        logits = runner.lean.forward(torch.tensor(ids[start:end]), torch.tensor(positions),
                                     torch.arange(end - start), runner.kv_caches, metadata, runner.attention_ops)
        targets = torch.tensor(ids[start + 1:end + 1])
        logp = logits[: len(targets)].float().log_softmax(-1)
        nll -= logp[torch.arange(len(targets)), targets].sum().item()
        count += len(targets)
    return math.exp(nll / count)


def decode_rate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of these chats at once, from the step after every prompt is in the cache."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"speed-{i}", prompt, params)
    while any(info.num_computed_tokens < len(prompt) for info, prompt in zip(engine.kv_snapshot().requests, prompts)):
        engine.step()
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        generated += sum(len(out.outputs[0].new_token_ids) for out in engine.step())
    return generated / (time.perf_counter() - start)


def pressure_preemptions(model_bytes_per_block: int, dtype: str, new_tokens: int) -> tuple[int, int]:
    """The pressure scene's six chats, each its first question under its own system prompt, at once, in the
    bytes of its pool of bf16 blocks: (blocks, preemptions)."""
    scene = SCENES["pressure"]
    llm = LLM(kv_cache_dtype=dtype, kv_cache_memory=scene.num_blocks * model_bytes_per_block, compile=False,
              num_threads=torch.get_num_threads())
    tokenizer = llm.get_tokenizer()
    prompts = [chat_prompt(tokenizer, [{"role": "system", "content": system},
                                       {"role": "user", "content": conversation[0]}])
               for system, conversation in zip(PROMPTS, CONVERSATIONS + CONVERSATIONS[:1])]
    greedy(llm, prompts, new_tokens)
    snap = llm.engine.kv_snapshot()
    return snap.num_blocks, snap.num_preemptions


def llama_greedy(prompts: list[list[int]], new_tokens: int, cache: str, port: int = 18393) -> list[list[int]] | str:
    """llama-server's greedy tokens on the shipped GGUF with flash attention and this K/V cache type."""
    if not peers.llama_ready():
        return "llama.cpp not built (python -m bench.peers setup --only llama)"
    context = len(prompts) * (max(map(len, prompts)) + new_tokens + 16)
    server = subprocess.Popen(
        [str(peers.llama_binary("llama-server")), "-m", str(peers.gguf_path("Q4_1")), "-t", str(os.cpu_count()),
         "-c", str(context), "-np", str(len(prompts)), "-fa", "on", "-ctk", cache, "-ctv", cache,
         "--host", "127.0.0.1", "--port", str(port), "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        peer_bench.wait_for_llama(url)
        out: list[list[int]] = [[] for _ in prompts]

        def complete(i: int) -> None:
            body = json.dumps({"prompt": prompts[i], "n_predict": new_tokens, "ignore_eos": True, "temperature": 0,
                               "cache_prompt": False, "return_tokens": True}).encode()
            request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=900) as response:
                out[i] = json.load(response)["tokens"]

        workers = [threading.Thread(target=complete, args=(i,)) for i in range(len(prompts))]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return out
    except OSError as error:
        return f"llama-server: {error}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, nothing written")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    # sized for ~10-15 minutes on 2 shared cores, most of it the 16 chats' prefill
    sizes = {"prompts": 32, "new": 128, "ppl": 1024, "long": 4000, "long_new": 64, "chats": 16, "chat_len": 1000,
             "chat_new": 32, "pressure_new": 320}
    if args.quick:
        sizes = {"prompts": 4, "new": 16, "ppl": 256, "long": 300, "long_new": 8, "chats": 3, "chat_len": 100,
                 "chat_new": 4, "pressure_new": 40}
    began = time.perf_counter()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(header({"torch threads": args.threads, "sizes": sizes}))
    section = Section(f"An 8-bit KV cache against the bf16 one, default model (issue 33; `python -m "
                      f"bench.kv_cache_bench`, {started})",
                      header({"torch threads": args.threads}).split("\n", 2)[2].strip().removeprefix("- ").split("\n- "))

    def report(table: Table) -> None:
        """Print a table and put the section so far into RESULTS.md: a run cut short leaves what it measured."""
        print(table.markdown(), flush=True)
        section.tables.append(table)
        section.seconds = time.perf_counter() - began
        if not args.quick:
            write_into_results(section.markdown(), marks=MARKS)

    llms = {dtype: LLM(kv_cache_dtype=dtype, kv_cache_memory="256MiB", compile=False, num_threads=args.threads)
            for dtype in ("auto",) + DTYPES}
    tokenizer = llms[REFERENCE].get_tokenizer()
    blocks = Table(["kv_cache_dtype", "bytes per block", "blocks in 256 MiB", "x bf16"],
                   [[d, llms[d].config.bytes_per_block, llms[d].config.engine.num_kv_blocks,
                     llms[d].config.engine.num_kv_blocks / llms[REFERENCE].config.engine.num_kv_blocks]
                    for d in llms], "Blocks for the same --kv-memory (the default model: 30 layers, 3 KV heads of 64)")
    del llms["auto"]
    report(blocks)

    readme_ids = tokenizer.encode((HERE.parent / "README.md").read_text())
    text_ids = readme_ids[: sizes["ppl"]]
    ppl = {dtype: perplexity(llm, text_ids) for dtype, llm in llms.items()}
    prompts = chat_prompts(tokenizer, sizes["prompts"])
    tokens = {dtype: greedy(llm, prompts, sizes["new"]) for dtype, llm in llms.items()}
    quality = Table(["cache", "perplexity", "x bf16 cache", f"greedy agreement (of {sizes['new']})"],
                    [[d, ppl[d], ppl[d] / ppl[REFERENCE], agreement(tokens[d], tokens[REFERENCE])] for d in llms],
                    f"Quality against the bf16 cache: README.md's first {len(text_ids)} tokens teacher-forced in "
                    f"chunks of {PERPLEXITY_CHUNK}; {len(prompts)} chat prompts x {sizes['new']} greedy tokens")
    llama = {cache: llama_greedy(prompts, sizes["new"], cache) for cache in ("f16", "q8_0")}
    if all(isinstance(v, list) for v in llama.values()):
        quality.rows.append(["llama.cpp q8_0 (against its f16)", "n/a (llama-perplexity not built)", "",
                             agreement(llama["q8_0"], llama["f16"])])
    else:
        quality.rows.append(["llama.cpp q8_0", next(v for v in llama.values() if isinstance(v, str)), "", ""])
    report(quality)

    speed_rows = []
    for dtype in (REFERENCE, "int8"):
        # a fresh engine whose pool holds all 16 chats at once in either dtype (256 MiB of bf16 would not)
        llm = LLM(kv_cache_dtype=dtype, kv_cache_memory="512MiB", compile=False, num_threads=args.threads)
        one = decode_rate(llm, [(readme_ids * 2)[: sizes["long"]]], sizes["long_new"])
        many = decode_rate(llm, [[100 + (i * 7919 + j * 104729) % 40000 for j in range(sizes["chat_len"])]
                                 for i in range(sizes["chats"])], sizes["chat_new"])
        speed_rows.append([dtype, one, many])
        print(dtype, one, many, flush=True)
    for row in speed_rows:
        row += [row[1] / speed_rows[0][1], row[2] / speed_rows[0][2]]
    speed = Table(["cache", f"1 chat at {sizes['long']} tok/s", f"{sizes['chats']} chats at {sizes['chat_len']} tok/s",
                   "1 chat x bf16", f"{sizes['chats']} chats x bf16"], speed_rows,
                  f"Decode speed (prefill not timed), {args.threads} threads")
    report(speed)

    bf16_block = llms[REFERENCE].config.bytes_per_block
    del llms
    pressure = Table(["cache", "blocks", "preemptions"],
                     [[d, *pressure_preemptions(bf16_block, d, sizes["pressure_new"])] for d in (REFERENCE, "int8")],
                     f"The pressure scene's six chats x {sizes['pressure_new']} greedy tokens in the bytes of "
                     f"{SCENES['pressure'].num_blocks} bf16 blocks")
    report(pressure)

    int8 = {row[0]: row for row in quality.rows}["int8"]
    llama_row = quality.rows[-1]
    goals = Table(["measure", "int8 cache", "goal", "met"], [
        ["blocks for the same --kv-memory, x bf16", blocks.rows[2][3], ">= 1.85", blocks.rows[2][3] >= 1.85],
        ["perplexity, x bf16 cache", int8[2], "<= 1.01", int8[2] <= 1.01],
        [f"greedy agreement (of {sizes['new']})", int8[3], f">= llama.cpp q8_0's ({llama_row[3]})",
         isinstance(llama_row[3], float) and int8[3] >= llama_row[3]],
        [f"1 chat at {sizes['long']}, x bf16", speed_rows[1][3], ">= 1.1", speed_rows[1][3] >= 1.1],
        [f"{sizes['chats']} chats at {sizes['chat_len']}, x bf16", speed_rows[1][4], ">= 1.0", speed_rows[1][4] >= 1.0],
        ["pressure scene preemptions, bf16 -> int8", f"{pressure.rows[0][2]} -> {pressure.rows[1][2]}", "fewer",
         pressure.rows[1][2] < pressure.rows[0][2]],
    ], "Goals (issue 33)")
    report(goals)
    section.tables.insert(0, section.tables.pop())  # the goals first
    if not args.quick:
        write_into_results(section.markdown(), marks=MARKS)


if __name__ == "__main__":
    main()
