"""One chat's decode step compiled by inductor in the background, while the eager forward serves.

A chat decoding alone is what a person does most, and where its matmuls are torch's own (fp16 on a CPU
with bf16 instructions, or bf16 where cpu_gemm cannot be built: KernelPlan.one_row_is_torch_product)
much of its eager step is per-op cost. Compiled, the ops between the matmuls (norms, rotary, the attention over the
gathered blocks, SiLU) become a few C++ loops: the default model's bf16 step on torch's product went from
~28 to ~21-23 ms on the 2-core AVX2 machines. Compiling takes 1.5-2 minutes there, so it never happens
where the user waits:
a thread compiles on a warm-up input that writes only to a scratch block of the KV pool (one block
more than the pool hands out), and the runner uses the compiled step once it is ready. Inductor's
caches live in the user cache folder, so a second start finds the compiled code (~15-20 s, still in the
background). Anything that fails while compiling (no C++ compiler, say) is logged, and the eager
forward goes on serving (a compile that failed is tried again at a later step, three times in all).

torch.compile keys its code on torch's thread count, which the thread policy (threads.py) may change:
the step is compiled again, in the background, for each count the engine comes to run at.

Only a batch of one sequence is compiled: a batch of several runs its matmuls at several rows, where
they dominate and compiling gains little.
"""

import logging
import os
import threading
from pathlib import Path

import platformdirs
import torch

from pagedchat.engine.models.llama import LlamaModel

log = logging.getLogger(__name__)

MAX_TRIES = 3
COMPILE_ENV = "PAGEDCHAT_COMPILE"  # "0": LLM and the app do not compile unless asked to
THREAD_NAME = "pagedchat-compile"


def compiling_by_default() -> bool:
    return os.environ.get(COMPILE_ENV, "1") != "0"


def compiling() -> bool:
    """Whether a compile is still under way in its thread (in inductor's C++ most of the time)."""
    return any(thread.name == THREAD_NAME and thread.is_alive() for thread in threading.enumerate())


def compile_cache_dir() -> Path:
    return platformdirs.user_cache_path("pagedchat", appauthor=False) / "inductor"  # honours XDG_CACHE_HOME


def use_compile_cache_dir() -> None:
    """Inductor's caches in the user cache folder, unless TORCHINDUCTOR_CACHE_DIR names another folder.
    Importing torch._dynamo (transformers does) already wrote inductor's default, in /tmp, into the variable."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())


class CompiledDecode:
    """The lean model's decode step for one sequence, compiled by a background thread.

    torch.compile keys what it compiled on torch's thread count, which the thread policy changes: the
    step is compiled for each count the engine runs at, in the background, when the engine first runs at
    it, and used at the counts it is ready for."""

    def __init__(self, lean: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scratch_block: int):
        self.lean = lean
        self.kv_caches = kv_caches
        self.scratch_block = scratch_block
        use_compile_cache_dir()
        # the compiled loops run on one thread: their work is small, and the thread count baked into them
        # would not follow the thread policy (threads.py) as the matmuls they call do
        self.fn = torch.compile(lean.decode, dynamic=True, fullgraph=True, options={"cpp.threads": 1})
        self.ready_threads: set[int] = set()
        self.error: str | None = None  # why compiling gave up
        self.failures = 0
        self._thread: threading.Thread | None = None
        self.prepare()

    def ready(self) -> bool:
        return torch.get_num_threads() in self.ready_threads

    def prepare(self) -> None:
        """Compile for the current thread count in the background, unless ready, under way or failed."""
        if self.error is None and not self.ready() and not (self._thread and self._thread.is_alive()):
            self._thread = threading.Thread(target=self._compile, args=(torch.get_num_threads(),),
                                            name=THREAD_NAME, daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the step is ready at the current thread count, after waiting up to `timeout` seconds for
        the compile under way."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.ready()

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        return self.fn(input_ids, positions, slot_mapping, block_tables, seq_lens, self.kv_caches)

    def pad_table(self, table: list[int]) -> list[int]:
        """A block table as the compiled step takes it: two entries at least (a one-entry table would be a
        shape of its own to compile), padding read from the scratch block and masked."""
        return table + [self.scratch_block] * (2 - len(table))

    def _compile(self, threads: int) -> None:
        try:
            block_size = self.kv_caches[0][0].shape[1]
            device = self.lean.embed.device

            def tensor(values):
                return torch.tensor(values, dtype=torch.long, device=device)

            with torch.inference_mode():  # token 0 at position 0, written to the scratch block's first slot
                self(tensor([0]), tensor([0]), tensor([self.scratch_block * block_size]),
                     tensor([self.pad_table([self.scratch_block])]), tensor([1]))
            if torch.get_num_threads() == threads:  # else the policy moved while compiling: compiled for another
                self.ready_threads.add(threads)
        except Exception as exc:  # noqa: BLE001 - whatever inductor raises, the eager forward serves on
            # a passing cause (another thread changed torch's default dtype mid-trace, as loading a
            # transformers model does) gets another try at a later step; a lasting one (no compiler) gives up
            self.failures += 1
            log.warning("compiling the decode step failed (try %d of %d)", self.failures, MAX_TRIES, exc_info=True)
            if self.failures == MAX_TRIES:
                self.error = f"{type(exc).__name__}: {exc}"
