"""pagedchat against llama.cpp on the GGUF files a user has (issue 31): real-size shapes with random weights
(bench/models.py), each engine in its own process, alternating, on the same token ids and the same file.

    python -m bench.peers setup --only llama     # once
    python -m bench.gguf_bench                   # 1B Q4_K_M and Q8_0; its section goes into bench/RESULTS.md
    python -m bench.gguf_bench --shapes 1b 3b --types Q4_K_M --rounds 3
    python -m bench.gguf_bench --shapes --default-model  # the default model's own Q4_1 file alone
    python -m bench.gguf_bench --files 1b:Q4_K_M 1b:Q8_0 3b:Q4_K_M 8b:Q4_K_M --default-model  # the issue's table

Workloads (bench/peer_timing.py): one chat (a 43-token chat prompt, 128 new tokens: decode tokens/s) and 16
chats x 64 new tokens at once (llama-server with 16 slots); KV for 4,096 tokens in each engine; greedy, EOS
ignored. Beside them: peak RSS, load time (the file in the page cache: a second start), and the disk
pagedchat uses beyond the GGUF (its caches). The 8B shape runs one chat alone (`ONE_CHAT_ONLY`: its 16 chats
would take each engine minutes a round), so its peak RSS is one chat's, with llama-server at one slot."""

import argparse
import time
from pathlib import Path

from bench import gguf_logits, models, peer_bench, peers
from bench.common import Section, Table, cpu_description, load_average

KV_TOKENS = 4096
ONE_CHAT_ONLY = {"8b"}
MARK_BEGIN, MARK_END = "<!-- gguf: begin -->", "<!-- gguf: end -->"


def job_for(path: Path, threads: int, rounds: int) -> dict:
    from transformers import AutoTokenizer

    from pagedchat.engine.loading import loader

    default = loader.default_model_file()
    tokenizer = AutoTokenizer.from_pretrained(default.parent, gguf_file=default.name)
    job = peer_bench.make_job(tokenizer, len(tokenizer), path, "auto", threads, rounds)
    del job["workloads"]["chat mix"]
    job["kv_tokens"] = KV_TOKENS
    return job


def default_model() -> Path:
    from pagedchat.engine.loading import loader

    return loader.default_model_file()


def cache_bytes() -> int:
    """What pagedchat keeps under its cache folder, the bench's own peers and models aside."""
    root = peers.peers_dir().parent
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()
               and not f.is_relative_to(peers.peers_dir()) and not f.is_relative_to(models.models_dir()))


def run(shape: str, file_type: str, threads: int, rounds: int, alternations: int) -> dict:
    path = default_model() if shape == "default" else models.build(shape, file_type)
    job = job_for(path, threads, rounds)
    if shape in ONE_CHAT_ONLY:
        del job["workloads"]["16 chats x 64"]
    runs: dict[str, list[dict]] = {"pagedchat": [], "llama.cpp": []}
    before = cache_bytes()
    for _ in range(alternations):
        peer_bench.wait_until_quiet()
        runs["pagedchat"].append(peer_bench.run_pagedchat(job))
        peer_bench.wait_until_quiet()
        runs["llama.cpp"].append(peer_bench.run_llama(job, gguf=path))
    disk_mb = (cache_bytes() - before) / 1e6
    peer_bench.wait_until_quiet()
    return {"path": path, "runs": runs, "disk_mb": disk_mb, "logits": gguf_logits.measure(path, threads)}


def best(results: list[dict], workload: str) -> float | None:
    values = [r[workload]["tok_s"] for r in results if workload in r]
    return max(values) if values else None


def smallest(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if key in r]
    return min(values) if values else None


def section(args, measured: dict, seconds: float) -> Section:
    table = Table(["model", "file", "engine", "one chat tok/s", "16 chats tok/s", "peak RSS MB", "load s",
                   "x llama.cpp (1 / 16 / RSS / load)"], [])
    plans, errors = set(), []
    for (shape, file_type), m in measured.items():
        ours = m["runs"]["pagedchat"]
        plans |= {r["kernel_plan"] for r in ours if "kernel_plan" in r}
        errors += [f"{shape} {file_type} {name}: {r['error']}" for name, rs in m["runs"].items() for r in rs
                   if "error" in r]
        row = {}
        for name, results in m["runs"].items():
            row[name] = (best(results, "one chat"), best(results, "16 chats x 64"), smallest(results, "peak_rss_mb"),
                         smallest(results, "load_s"))
        ratio = [f"{a / b:.2f}" if a and b else "n/a" for a, b in zip(row["pagedchat"], row["llama.cpp"])]
        for name in ("pagedchat", "llama.cpp"):
            one, many, rss, load = row[name]
            table.rows.append([shape, f"{file_type} ({m['path'].stat().st_size / 1e9:.2f} GB)", name, one, many, rss, load,
                       " / ".join(ratio) if name == "pagedchat" else ""])
    cpu = cpu_description()
    settings = [f"machine: {cpu['cpu']}, {cpu['cores']} cores, flags: {cpu['flags']}",
                f"peer: llama.cpp {peers.LLAMA_CPP_PYTHON.split('==')[1]} (vendored in llama-cpp-python, "
                f"{peers.LLAMA_BUILD}) `llama-server`, 16 slots; each engine in its own process, alternating",
                f"{args.threads} threads, KV for {KV_TOKENS} tokens in each engine, {args.rounds} rounds x "
                f"{args.alternations} alternations; load average at end {load_average()}",
                "pagedchat's kernel plan: " + ("; ".join(sorted(plans)) or "n/a"),
                "pagedchat's disk beyond the GGUF (its cache folder grew by): "
                + ", ".join(f"{s} {t} {m['disk_mb']:.1f} MB" for (s, t), m in measured.items())]
    notes = ["Random weights (std 0.02) of the real shapes with the default model's tokenizer (bench/models.py); "
             "F16 written by gguf's writer, quantized by llama.cpp's llama-quantize.",
             "one chat: decode tokens/s of a 128-token reply; 16 chats: generated tokens per wall second, 16 x 64; "
             "best of the rounds and alternations. Load: process spawn to ready (llama-server: to its /health), "
             "the file in the page cache, the fastest start."]
    constructs = {key: smallest(m["runs"]["pagedchat"], "construct_s") for key, m in measured.items()}
    notes.append("Of pagedchat's load, the engine's own construction (the file mapped, its tokenizer read): "
                 + ", ".join(f"{s} {t} {c:.2f} s" for (s, t), c in constructs.items() if c is not None)
                 + "; the rest is the interpreter and its imports (torch above all; a second start imports no "
                   "transformers).")
    notes += errors
    notes.append("Logits: " + gguf_logits.__doc__.split("\n\n")[2].replace("\n", " "))
    logits = gguf_logits.table({key: (m["path"], m["logits"]) for key, m in measured.items()})
    return Section("GGUF models: pagedchat against llama.cpp on the same file (issue 31)", settings, [table, logits],
                   notes, seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="*", default=["1b"], choices=tuple(models.SHAPES))
    parser.add_argument("--types", nargs="+", default=list(models.TYPES))
    parser.add_argument("--files", nargs="+", metavar="SHAPE:TYPE", help="these files instead of shapes x types")
    parser.add_argument("--default-model", action="store_true", help="also the default model's shipped Q4_1 file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--alternations", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print the section, leave RESULTS.md alone")
    args = parser.parse_args(argv)
    if not peers.llama_ready():
        raise SystemExit("llama.cpp is not built: python -m bench.peers setup --only llama")
    started = time.monotonic()
    files = [tuple(name.split(":")) for name in args.files] if args.files else \
        [(shape, file_type) for shape in args.shapes for file_type in args.types]
    files += [("default", "Q4_1")] if args.default_model else []
    measured = {(shape, file_type): run(shape, file_type, args.threads, args.rounds, args.alternations)
                for shape, file_type in files}
    markdown = section(args, measured, time.monotonic() - started).markdown()
    print(markdown)
    if not args.no_write:
        peer_bench.write_into_results(markdown, marks=(MARK_BEGIN, MARK_END))


if __name__ == "__main__":
    main()
