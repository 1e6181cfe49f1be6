"""pagedchat's logits against llama.cpp's on the same GGUF file and the same tokens, teacher-forced (issue 31).

    python -m bench.gguf_logits --files 1b:Q4_K_M 1b:Q8_0 --default-model

The tokens: a chat prompt and a written answer (186 tokens, the default model's tokenizer). pagedchat gives
the logits of every position in one prefill; llama-server (its build from `python -m bench.peers setup`)
gives, position by position with its prompt cache, the log-probabilities of its 40 most likely tokens at each
(its API returns no more; none where its pick is part of a UTF-8 character, which it holds back: those
positions are left out). At each position: top-1 agreement (pagedchat's greedy token is llama.cpp's), the
cosine of the two engines' log-probabilities over llama.cpp's 40 tokens (each centred: logits are
log-probabilities up to a constant), and the gap between them on llama.cpp's first token. Both engines
quantize activations to 8 bits per block (llama.cpp's Q8_0 / Q8_K pairing): they differ in rounding (the
order of sums, the KV cache's precision), not in method."""

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

from bench import models, peer_bench, peers
from bench.common import Section, Table, cpu_description, load_average

TOP = 40
QUESTION = "Explain how a CPU cache works, briefly, for a student."
ANSWER = ("A CPU cache is a small, fast memory close to the processor. When the processor needs data, it looks "
          "in the cache first; if the data is there (a hit), it is returned in a few cycles, and if not (a miss), "
          "it is fetched from main memory, which is much slower, and a copy is kept in the cache for next time. "
          "Caches work because programs tend to reuse the same data soon (temporal locality) and to use data "
          "stored near what they just used (spatial locality), so data moves in lines of 64 bytes. Modern CPUs "
          "have several levels: a tiny L1 per core, a larger L2, and a shared L3.")


def token_ids() -> list[int]:
    from transformers import AutoTokenizer

    from pagedchat.engine.loading import loader

    default = loader.default_model_file()
    tokenizer = AutoTokenizer.from_pretrained(default.parent, gguf_file=default.name)
    chat = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}]
    return tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)


def pagedchat_log_probs(path: Path, ids: list[int], threads: int) -> torch.Tensor:
    """[len(ids), vocab]: log-softmax of the logits after each prefix of ids, in one teacher-forced prefill."""
    from pagedchat import LLM
    from pagedchat.kernels import AttentionMetadata, torch_ops

    torch.set_num_threads(threads)
    llm = LLM(model=str(path), dtype="auto", device="cpu", num_threads=threads, attention_backend="torch",
              num_kv_blocks=-(-len(ids) // 16) + 1, max_model_len=len(ids))
    runner = llm.engine.runner
    table = list(range(-(-len(ids) // runner.block_size)))
    metadata = AttentionMetadata.build([table], [len(ids)], [len(ids)], list(range(len(ids))))
    positions = torch.arange(len(ids))
    with torch.inference_mode():
        logits = runner.lean.forward(torch.tensor(ids), positions, positions, runner.kv_caches, metadata, torch_ops)
    return torch.log_softmax(logits.float(), dim=-1)


def llama_top(path: Path, ids: list[int], threads: int, port: int = 18392) -> list[list[tuple[int, float]] | None]:
    """At each position of ids, llama-server's TOP (token, log-probability) for the next token; None where it
    withholds them (its pick there is part of a UTF-8 character, which it keeps back with its probabilities)"""
    server = subprocess.Popen([str(peers.llama_binary("llama-server")), "-m", str(path), "-t", str(threads), "-c",
                               str(len(ids) + 16), "-np", "1", "--host", "127.0.0.1", "--port", str(port),
                               "--no-webui"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        peer_bench.wait_for_llama(url, tries=1200)  # up to two minutes to load
        tops = []
        for end in range(1, len(ids) + 1):  # each prefix extends the last: the slot's prompt cache keeps its KV
            # ignore_eos: where the likeliest token ends a turn, it still comes back with its probabilities
            body = json.dumps({"prompt": ids[:end], "n_predict": 1, "n_probs": TOP, "temperature": 0,
                               "ignore_eos": True, "cache_prompt": True}).encode()
            request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as response:
                answer = json.load(response).get("completion_probabilities")
            tops.append([(t["id"], t["logprob"]) for t in answer[0]["top_logprobs"]] if answer else None)
        return tops
    finally:
        server.terminate()
        server.wait(timeout=30)


def compare(ours: torch.Tensor, theirs: list[list[tuple[int, float]] | None]) -> dict[str, float]:
    agree, cosines, gaps = [], [], []
    for position, top in enumerate(theirs):
        if top is None:
            continue
        ids = torch.tensor([token for token, _ in top])
        want = torch.tensor([value for _, value in top], dtype=torch.float64)
        got = ours[position, ids].double()
        agree.append(int(ours[position].argmax()) == top[0][0])
        a, b = got - got.mean(), want - want.mean()
        cosines.append(float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30)))
        gaps.append(abs(float(got[0] - want[0])))
    return {"positions": len(agree), "top1": float(np.mean(agree)), "cosine_mean": float(np.mean(cosines)),
            "cosine_min": float(np.min(cosines)), "gap_mean": float(np.mean(gaps)), "gap_max": float(np.max(gaps))}


def measure(path: Path, threads: int) -> dict[str, float]:
    ids = token_ids()
    ours = pagedchat_log_probs(path, ids, threads)
    return compare(ours, llama_top(path, ids, threads))


def table(measured: dict[tuple[str, str], dict]) -> Table:
    rows = [[shape, f"{file_type} ({path.stat().st_size / 1e9:.2f} GB)", m["positions"], f"{m['top1']:.3f}",
             f"{m['cosine_mean']:.4f} / {m['cosine_min']:.4f}", f"{m['gap_mean']:.3f} / {m['gap_max']:.3f}"]
            for (shape, file_type), (path, m) in measured.items()]
    return Table(["model", "file", "positions", "top-1 agreement", f"cosine over llama.cpp's top {TOP} (mean / min)",
                  "|log-prob gap| on its first token (mean / max)"], rows)


def file_path(shape: str, file_type: str) -> Path:
    from pagedchat.engine.loading import loader

    return loader.default_model_file() if shape == "default" else models.build(shape, file_type)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="*", default=["1b:Q4_K_M"], metavar="SHAPE:TYPE")
    parser.add_argument("--default-model", action="store_true", help="also the default model's shipped Q4_1 file")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if not peers.llama_ready():
        raise SystemExit("llama.cpp is not built: python -m bench.peers setup --only llama")
    started = time.monotonic()
    files = [tuple(name.split(":")) for name in args.files] + ([("default", "Q4_1")] if args.default_model else [])
    measured = {}
    for shape, file_type in files:
        path = file_path(shape, file_type)
        measured[(shape, file_type)] = (path, measure(path, args.threads))
        print(f"{shape} {file_type}: {measured[(shape, file_type)][1]}", file=sys.stderr)
    cpu = cpu_description()
    print(Section("GGUF logits: pagedchat against llama.cpp, teacher-forced on the same file (issue 31)",
                  [f"machine: {cpu['cpu']}, {cpu['cores']} cores, flags: {cpu['flags']}",
                   f"{args.threads} threads; load average at end {load_average()}"],
                  [table(measured)], [__doc__.split("\n\n")[2].replace("\n", " ")],
                  time.monotonic() - started).markdown())


if __name__ == "__main__":
    main()
