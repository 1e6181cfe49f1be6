"""What every benchmark shares: the machine's description, settings, workloads, timing and tables.

Absolute times on a 2-core machine shared with other jobs mean little, so each benchmark runs its
peers side by side in one process and reports ratios; the header records what the machine was
doing (load average) so a reader can judge the noise.
"""

import argparse
import importlib.metadata
import os
import platform
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

# CPU features that decide which dtype is fast: without avx512_bf16 or AMX, bf16 matmuls are emulated.
INTERESTING_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---- results ------------------------------------------------------------------------------------


@dataclass
class Table:
    headers: list[str]
    rows: list[list[object]]
    title: str = ""

    def markdown(self) -> str:
        lines = [f"**{self.title}**", ""] if self.title else []
        lines.append("| " + " | ".join(self.headers) + " |")
        lines.append("|" + "|".join("---" for _ in self.headers) + "|")
        lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass
class Section:
    """One benchmark's report: settings line(s), tables, and what it concludes against its goal."""

    title: str
    settings: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    chart: dict[str, tuple[float, float | None]] = field(default_factory=dict)  # label -> (ratio, goal)

    def markdown(self) -> str:
        parts = [f"## {self.title}", ""]
        parts += [f"- {line}" for line in self.settings]
        for table in self.tables:
            parts += ["", table.markdown()]
        if self.notes:
            parts.append("")
            parts += [f"- {line}" for line in self.notes]
        parts += ["", f"_{self.seconds:.0f} s_", ""]
        return "\n".join(parts)


def fmt(value: object) -> str:
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3f}"
    return str(value)


def goal(name: str, value: float, target: float, higher_is_better: bool = True, unit: str = "x") -> str:
    met = value >= target if higher_is_better else value <= target
    sign = ">=" if higher_is_better else "<="
    return f"goal {name} {sign} {target:g}{unit}: {value:.2f}{unit} -> {'met' if met else 'MISSED'}"


# ---- the machine --------------------------------------------------------------------------------


def cpu_description() -> dict[str, str]:
    """The CPU's name with its family and model numbers (a virtual machine's name may be a vendor's line alone,
    "AMD EPYC", which the numbers tell apart: family 23 is Zen 1 or 2, 25 Zen 3 or 4), its flags of note."""
    model, flags, numbers = platform.processor() or "unknown", set(), {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                elif key.strip() in ("cpu family", "model"):
                    numbers.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if numbers:
        model += f" (family {numbers.get('cpu family', '?')}, model {numbers.get('model', '?')})"
    return {
        "cpu": model,
        "flags": " ".join(f for f in INTERESTING_FLAGS if f in flags) or "none of " + "/".join(INTERESTING_FLAGS),
        "missing": " ".join(f for f in INTERESTING_FLAGS if f not in flags),
        "cores": str(os.cpu_count()),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
    }


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("transformers", "pagedchat", "textual"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


def load_average() -> str:
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def header(settings: dict[str, object]) -> str:
    cpu, ver = cpu_description(), versions()
    lines = [
        "# pagedchat benchmarks",
        "",
        f"- machine: {cpu['cpu']}, {cpu['cores']} cores, torch CPU capability {cpu['torch_capability']}; "
        f"flags: {cpu['flags']}" + (f" (no {cpu['missing']})" if cpu["missing"] else ""),
        f"- load average at start (1/5/15 min): {load_average()} -- other jobs share these cores; "
        "compare ratios, not absolute times",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in ver.items()),
    ]
    lines += [f"- {k}: {v}" for k, v in settings.items()]
    return "\n".join(lines) + "\n"


# ---- timing -------------------------------------------------------------------------------------


@dataclass
class Times:
    """Wall seconds, and this process's CPU seconds (all its threads). With one torch thread, CPU time
    is the work done whatever else the machine runs: other jobs stretch wall time, not CPU time."""

    wall: float = 0.0
    cpu: float = 0.0


@contextmanager
def stopwatch() -> Iterator[Times]:
    """`with stopwatch() as t: ...` then t.wall and t.cpu hold the seconds."""
    box = Times()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield box
    finally:
        box.wall, box.cpu = time.perf_counter() - wall, time.process_time() - cpu


class Accumulator:
    """Wraps a callable and adds up the seconds spent in it (e.g. the model forward inside a step)."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def layer_shapes(config) -> list[tuple[int, int]]:
    """(in, out) features of one decoder layer's linears: q, k, v, o, gate, up, down."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]


def matmul_gflops(dtype: torch.dtype, rows: int, shapes: Sequence[tuple[int, int]] = ((576, 1536),),
                  trials: int = 5, seconds: float = 0.1, linear: Callable = F.linear) -> float:
    """GFLOP/s of `linear` at `rows` rows over the given (in, out) weight shapes: the compute ceiling
    (with a model's layer_shapes, exactly the matmuls one of its layers does per step); pass
    `cpu_linear.linear_for(dtype, cpu)` for the route pagedchat's layers take. The best of a few short
    trials, timed in CPU time with one torch thread (like the peers), else in wall time."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    xs = {k: torch.randn(rows, k, dtype=dtype) for k, _ in shapes}
    weights = [torch.randn(n, k, dtype=dtype) for k, n in shapes]
    flops = sum(2 * rows * k * n for k, n in shapes)
    best = 0.0
    with torch.inference_mode():
        for weight in weights:
            linear(xs[weight.shape[1]], weight, None)
        for _ in range(trials):
            count, start = 0, clock()
            while (elapsed := clock() - start) < seconds:
                for weight in weights:
                    linear(xs[weight.shape[1]], weight, None)
                count += 1
            best = max(best, flops * count / elapsed / 1e9)
    return best


def configure_threads(threads: int | None) -> int:
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def arg_parser(doc: str, dtypes: list[str]) -> argparse.ArgumentParser:
    """The flags every benchmark script has; add its own, then call `start`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the default model)")
    parser.add_argument("--dtype", nargs="+", default=dtypes)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: see bench/run.py)")
    return parser


def start(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse, set the torch threads, print the header."""
    args = parser.parse_args()
    print(header({"torch threads": configure_threads(args.threads)}))
    return args


# ---- workloads ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int  # generated exactly (EOS ignored), so every peer does the same work


def random_requests(n: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], seed: int = 0,
                    vocab: int = 49152) -> list[Request]:
    """n requests with uniform lengths in the given ranges (inclusive); token ids avoid special tokens."""
    rng = random.Random(seed)
    return [Request(random_tokens(rng, rng.randint(*prompt_lens), vocab), rng.randint(*output_lens)) for _ in range(n)]


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    margin = min(100, vocab // 4)  # special tokens sit at either end of a vocabulary
    return [rng.randrange(margin, vocab - margin) for _ in range(n)]


def fixed_requests(n: int, prompt_len: int, output_len: int, seed: int = 0, vocab: int = 49152) -> list[Request]:
    return random_requests(n, (prompt_len, prompt_len), (output_len, output_len), seed, vocab)


def describe(requests: Sequence[Request]) -> str:
    p = [len(r.prompt) for r in requests]
    o = [r.output_len for r in requests]
    return (f"{len(requests)} requests, prompts {min(p)}..{max(p)} tokens (mean {sum(p) / len(p):.0f}), "
            f"outputs {min(o)}..{max(o)} tokens (mean {sum(o) / len(o):.0f})")


# ---- models -------------------------------------------------------------------------------------


def model_config(model: str | None):
    """The model's config, read (and checked) without loading the weights."""
    from pagedchat.engine.loading import loader

    return loader.check_model(loader.resolve_model(model), None)


def load_llm(model: str | None, dtype: str, **engine_args):
    from pagedchat import LLM

    # the suite's --threads holds: the engine's own policy (threads = free cores) is measured in bench.peer_bench
    engine_args.setdefault("num_threads", torch.get_num_threads())
    llm = LLM(model=model, dtype=dtype, device="cpu", **engine_args)
    print(f"kernel plan: {llm.engine.runner.plan.describe()}")
    return llm


def load_hf(model_path, dtype: str, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # a loading bar per peer would bury the tables
    model_path = Path(model_path)
    where = dict(pretrained_model_name_or_path=model_path.parent, gguf_file=model_path.name) \
        if model_path.suffix == ".gguf" else dict(pretrained_model_name_or_path=model_path)
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=DTYPES[dtype], attn_implementation=attn_implementation)
    return model.eval()


def flops_per_token(model) -> tuple[int, int]:
    """(FLOPs of the layers for every token, FLOPs of the vocabulary projection for a sampled token):
    2 x parameters, the embedding table counted only where it is a matmul (the LM head)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # a tied head is counted once here
    body = total - embed.numel() - (0 if head is embed else head.numel())
    return 2 * body, 2 * head.numel()


def stub_forward(engine) -> None:
    """Replace the model forward by zeros logits: for measurements that depend only on token counts
    (block usage, concurrency), where the real forward would cost hours on a CPU and change nothing."""
    vocab = engine.runner.model.config.vocab_size

    def forward(batch):
        return torch.zeros(sum(1 for item in batch if item.samples), vocab)

    engine.runner.forward = forward
