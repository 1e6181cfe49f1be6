import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from types import MappingProxyType, ModuleType

import torch

from pagedchat.engine import detokenizer
from pagedchat.engine.block_pool import BlockPool
from pagedchat.engine.kv_manager import KVCacheManager
from pagedchat.engine.model_runner import ModelRunner
from pagedchat.engine.outputs import CompletionOutput, RequestOutput
from pagedchat.engine.params import SamplingParams
from pagedchat.engine.sampler import sample
from pagedchat.engine.scheduler import Scheduler
from pagedchat.engine.sequence import Sequence, Status, make_generator
from pagedchat.engine.snapshot import BlockInfo, KVSnapshot, RequestInfo
from pagedchat.engine.threads import ThreadPolicy

log = logging.getLogger(__name__)

RATE_WINDOW_S = 2.0


@dataclass(slots=True)
class EngineConfig:
    num_kv_blocks: int
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch threads; None: the cores other processes leave free (threads.py)
    compile: bool = True  # compile the decode step in the background (CPU, torch backend; compiled_decode.py)

    def __post_init__(self) -> None:
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        for name in ("num_kv_blocks", "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len > self.num_kv_blocks * self.block_size:
            raise ValueError(
                f"max_model_len {self.max_model_len} does not fit the KV pool "
                f"({self.num_kv_blocks} blocks x {self.block_size} = {self.num_kv_blocks * self.block_size} tokens)"
            )


class LLMEngine:
    """The paged-KV engine: synchronous and single-threaded; every call takes effect at once."""

    def __init__(self, model, tokenizer, config: EngineConfig, attention_ops: ModuleType):
        self.tokenizer = tokenizer
        self.config = config
        self.pool = BlockPool(config.num_kv_blocks, config.block_size)
        self.kv = KVCacheManager(self.pool, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.threads = ThreadPolicy() if config.num_threads is None else None
        self.runner = ModelRunner(model, config.num_kv_blocks, config.block_size, attention_ops, config.max_model_len,
                                  config.compile)
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.groups: dict[str, list[Sequence]] = {}  # request id -> its samples
        self.step_count = 0
        self._reports: dict[str, None] = {}  # requests to report at the next step though they were not computed
        self._rate: deque[tuple[float, int]] = deque()
        self._just_finished: list[Sequence] = []

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, keep: bool = False
    ) -> None:
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        params = params or SamplingParams()
        seq = Sequence(request_id, request_id, 0, [], params, self.config.max_model_len, keep)
        seq.start_turn(token_ids, params)
        self.groups[request_id] = [seq]
        self._enqueue(seq)

    def continue_request(self, request_id: str, new_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Append the next message to a parked (or released) conversation and generate again."""
        group = self._group(request_id)
        if any(seq.status not in (Status.PARKED, Status.FINISHED) for seq in group):
            raise ValueError(f"request {request_id!r} is still generating")
        if not new_token_ids:
            raise ValueError("the new message is empty")
        for seq in group:
            self.scheduler.parked.pop(seq.seq_id, None)
            seq.start_turn(list(new_token_ids), params or seq.params)
            self._enqueue(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop generating at once; the request's blocks are freed, or kept (parked) if it was added with keep."""
        for seq in self._group(request_id):
            if seq.status in (Status.WAITING, Status.RUNNING, Status.PREEMPTED):
                self._finish(seq, "abort")

    def release_request(self, request_id: str) -> None:
        """Free a conversation's blocks into the prefix cache; it keeps its tokens and can be continued."""
        self.abort_request(request_id)
        for seq in self._group(request_id):
            self.scheduler.parked.pop(seq.seq_id, None)
            if seq.block_table:
                self.scheduler.release(seq)
            seq.status = Status.FINISHED

    def fork_request(self, src_id: str, new_id: str, params: SamplingParams | None = None) -> None:
        """A new request with src's tokens and status that shares all of src's blocks (copy-on-write)."""
        src = self._group(src_id)[0]
        if new_id in self.groups:
            raise ValueError(f"request id {new_id!r} is already in use")
        dst = self._fork(src, new_id, new_id, 0, params)
        self.groups[new_id] = [dst]
        self._reports[new_id] = None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._reports)

    def _group(self, request_id: str) -> list[Sequence]:
        if request_id not in self.groups:
            raise ValueError(f"unknown request id {request_id!r}")
        return self.groups[request_id]

    def _enqueue(self, seq: Sequence) -> None:
        limit = min(self.config.max_model_len, self.config.num_kv_blocks * self.config.block_size)
        if len(seq) >= limit:
            self._finish(
                seq, "error",
                f"the prompt is {len(seq)} tokens, but the context holds {limit} (max_model_len "
                f"{self.config.max_model_len}, KV pool {self.config.num_kv_blocks * self.config.block_size} tokens)",
            )
            return
        seq.status = Status.WAITING
        self.scheduler.waiting.append(seq)

    def _fork(self, src: Sequence, seq_id: str, request_id: str, index: int, params: SamplingParams | None) -> Sequence:
        dst = replace(
            src, seq_id=seq_id, request_id=request_id, index=index, token_ids=list(src.token_ids),
            params=params or src.params, block_table=[], block_hashes=[], new_token_ids=list(src.new_token_ids),
        )
        if params is not None or index != src.index:
            dst.generator = make_generator(dst.params.seed, index)
        elif src.generator is not None:
            dst.generator = torch.Generator()
            dst.generator.set_state(src.generator.get_state())
        self.kv.fork(src, dst)
        if dst.status is Status.RUNNING:
            self.scheduler.running.append(dst)
        elif dst.status in (Status.WAITING, Status.PREEMPTED):
            self.scheduler.waiting.append(dst)
        elif dst.status is Status.PARKED:
            self.scheduler.park(dst)
        return dst

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one packed forward, sample; return one RequestOutput per request that moved."""
        self.step_count += 1
        self.pool.step = self.step_count
        if self.threads is not None:
            self.threads.update()
        started = time.perf_counter()
        scheduled = self.scheduler.schedule()
        num_sampled = 0
        if scheduled:
            try:
                if self.kv.pending_copies:
                    self.runner.copy_blocks(self.kv.pending_copies)
                    self.kv.pending_copies = []
                logits = self.runner.forward(scheduled)
            except Exception as exc:  # one bad batch must not take down the engine: fail it, serve the rest
                log.exception("engine step failed")
                self.kv.pending_copies = []
                for item in scheduled:
                    self._finish(item.seq, "error", f"engine error: {type(exc).__name__}: {exc}")
            else:
                sampling: list[Sequence] = []
                rows: list[int] = []
                for item in scheduled:
                    self.kv.commit(item.seq, item.num_tokens)
                    item.seq.last_used_step = self.step_count
                    if item.samples:
                        rows.append(len(sampling))
                        sampling.append(item.seq)
                for row, seq in list(zip(rows, sampling)):
                    if seq.params.n > 1 and len(self.groups[seq.request_id]) == 1:
                        for index in range(1, seq.params.n):
                            child = self._fork(seq, f"{seq.request_id}#{index}", seq.request_id, index, None)
                            self.groups[seq.request_id].append(child)
                            rows.append(row)
                            sampling.append(child)
                if sampling:
                    tokens = sample(logits[rows], sampling, self.eos_token_ids)
                    for seq, token in zip(sampling, tokens):
                        self._append_token(seq, token)
                    num_sampled = len(sampling)
        moved, self._reports = self._reports, {}
        moved.update(dict.fromkeys(item.seq.request_id for item in scheduled))
        now = time.perf_counter()
        self._rate.append((now, num_sampled))
        log.debug("step %d: %d seqs, %.1f ms", self.step_count, len(scheduled), (now - started) * 1e3)
        outputs = [self._output(request_id) for request_id in moved if request_id in self.groups]
        self._drop_finished(moved)
        return outputs

    def _append_token(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        seq.new_token_ids.append(token)
        added = detokenizer.detokenize_step(self.tokenizer, seq)
        seq.text += added
        seq.new_text += added
        params = seq.params
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            self._finish(seq, "stop")
        elif params.stop_strings and self._hit_stop_string(seq, len(added)):
            self._finish(seq, "stop", flush=False)
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            self._finish(seq, "length")
        elif len(seq) >= seq.max_len:
            self._finish(seq, "length")

    @staticmethod
    def _hit_stop_string(seq: Sequence, num_added: int) -> bool:
        for stop in seq.params.stop_strings:
            at = seq.text.find(stop, max(0, len(seq.text) - num_added - len(stop) + 1))
            if at >= 0:
                cut = len(seq.text) - at
                seq.text = seq.text[:at]
                seq.new_text = seq.new_text[: max(0, len(seq.new_text) - cut)]
                return True
        return False

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, flush: bool = True) -> None:
        if flush:
            tail = detokenizer.flush(self.tokenizer, seq)
            seq.text += tail
            seq.new_text += tail
        seq.finish_reason, seq.error = reason, error
        self.scheduler.remove(seq)
        self._reports[seq.request_id] = None
        if seq.keep and reason != "error":
            self.scheduler.park(seq)
        else:
            if seq.block_table:
                self.kv.free(seq)
            seq.status = Status.FINISHED
        seq.last_used_step = self.step_count

    def _drop_finished(self, request_ids) -> None:
        """Forget requests that finished without keep once their last output is out (their ids are free
        again); the snapshot of this step still shows them."""
        self._just_finished = []
        for rid in request_ids:
            group = self.groups.get(rid)
            if group and all(s.status is Status.FINISHED and not s.keep for s in group):
                self._just_finished += self.groups.pop(rid)

    def _output(self, request_id: str) -> RequestOutput:
        group = self.groups[request_id]
        outputs = []
        for seq in group:
            outputs.append(CompletionOutput(
                seq.index, seq.output_token_ids, seq.text, seq.new_token_ids, seq.new_text, seq.finish_reason, seq.error,
            ))
            seq.new_token_ids, seq.new_text = [], ""
        first = group[0]
        # A request whose first sample ended before producing a token never forks its other samples.
        finished = all(seq.finish_reason is not None for seq in group) and (
            len(group) == first.params.n or first.num_output_tokens == 0
        )
        return RequestOutput(
            request_id, first.token_ids[: first.turn_start], outputs, finished, first.num_cached_tokens
        )

    # ---- the picture ----------------------------------------------------------------------------

    def kv_snapshot(self) -> KVSnapshot:
        owners: dict[int, list[str]] = {}
        live = [seq for group in self.groups.values() for seq in group
                if seq.status is not Status.FINISHED or seq.last_used_step == self.step_count]
        live += self._just_finished
        for seq in live:
            for block_id in seq.block_table:
                owners.setdefault(block_id, []).append(seq.seq_id)
        blocks = tuple(
            BlockInfo(b.block_id, b.ref_count, len(b.token_ids), tuple(owners.get(b.block_id, ())),
                      b.ref_count == 0 and b.block_hash is not None, b.block_hash, tuple(b.token_ids))
            for b in self.pool.blocks
        )
        requests = tuple(
            RequestInfo(seq.seq_id, seq.status.value, tuple(seq.block_table), len(seq), seq.num_computed_tokens,
                        seq.num_cached_tokens, seq.max_len)
            for seq in live
        )
        now = time.perf_counter()
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()
        rate = sum(n for _, n in self._rate) / RATE_WINDOW_S
        return KVSnapshot(
            step=self.step_count,
            num_blocks=self.pool.num_blocks,
            block_size=self.pool.block_size,
            num_free_blocks=self.pool.num_free,
            num_cached_blocks=self.pool.num_cached_free,
            blocks=blocks,
            requests=requests,
            block_tables=MappingProxyType({r.request_id: r.block_table for r in requests}),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_parked=len(self.scheduler.parked),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            tokens_per_second=rate,
            events=tuple(self.pool.events),
        )


def _eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (model.generation_config.eos_token_id, model.config.eos_token_id, tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, list) else [source])
    return ids
