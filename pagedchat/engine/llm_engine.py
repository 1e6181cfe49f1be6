import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from types import MappingProxyType, ModuleType

import torch

from pagedchat.engine import detokenizer
from pagedchat.engine.chat import sample_id
from pagedchat.engine.core.block_pool import BlockPool
from pagedchat.engine.core.kv_manager import KVCacheManager
from pagedchat.engine.worker.model_runner import ModelRunner
from pagedchat.engine.api.outputs import CompletionOutput, RequestOutput
from pagedchat.engine.api.params import SamplingParams
from pagedchat.engine.worker.sampler import sample
from pagedchat.engine.core.scheduler import ScheduledSeq, Scheduler
from pagedchat.engine.core.sequence import Sequence, Status, make_generator
from pagedchat.engine.api.snapshot import BlockInfo, KVSnapshot, RequestInfo
from pagedchat.engine.runtime.threads import ThreadPolicy
from pagedchat.kernels import kv_quant

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
    kv_cache_dtype: torch.dtype | None = None  # None: the model's dtype; torch.int8 / torch.uint8: kv_quant.py
    weights_bytes: int = 0  # the weights in memory, as the config counted them (0: not known)

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
                                  config.compile, config.kv_cache_dtype)
        log.info("kernel plan: %s", self.runner.plan.describe())
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.groups: dict[str, list[Sequence]] = {}  # request id -> its samples: the requests the engine knows
        self.step_count = 0
        self._last_step: list[ScheduledSeq] = []  # what the last step ran: the snapshot's before-step counts
        # Requests that moved outside a step (aborted, closed, forked, refused), keyed by id(group): each
        # owes one output at the next step, even if its id is forgotten meanwhile.
        self._owed: dict[int, list[Sequence]] = {}
        self._rate: deque[tuple[float, int]] = deque()  # (time, tokens sampled) of the steps in the window

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

    def close_request(self, request_id: str) -> None:
        """End a conversation for good: stop it if it is generating (its last output, at the next step,
        says "abort"), free its blocks into the prefix cache and forget its id, which is free again."""
        self.release_request(request_id)
        del self.groups[request_id]

    def fork_request(self, src_id: str, new_id: str, params: SamplingParams | None = None) -> None:
        """A new request with src's tokens and status that shares all of src's blocks (copy-on-write)."""
        src = self._group(src_id)[0]
        if new_id in self.groups:
            raise ValueError(f"request id {new_id!r} is already in use")
        group = self.groups[new_id] = [self._fork(src, new_id, new_id, 0, params)]
        self._owed[id(group)] = group

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._owed)

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
        self.scheduler.add(seq)

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
        """Schedule, run one packed forward, sample, commit the tokens; return one RequestOutput per
        request that moved."""
        self.step_count += 1
        self.pool.step = self.step_count
        if self.threads is not None:
            self.threads.update()
        started = time.perf_counter()
        scheduled = self._last_step = self.scheduler.schedule()
        logits = self._run(scheduled) if scheduled else None
        sampled = self._sample(scheduled, logits) if logits is not None else []
        for seq, token in sampled:
            self._commit(seq, token)
        now = time.perf_counter()
        self._rate.append((now, len(sampled)))
        self._trim_rate(now)
        log.debug("step %d: %d seqs, %.1f ms", self.step_count, len(scheduled), (now - started) * 1e3)
        return self._report(scheduled)

    def _run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor | None:
        """The forward over every scheduled token, whose K/V is then in the cache: logits of the rows
        to sample, or None if it failed (those requests end with an error, the engine serves the rest)."""
        try:
            if self.kv.pending_copies:
                self.runner.copy_blocks(self.kv.pending_copies)
            logits = self.runner.forward(scheduled)
        except Exception as exc:
            log.exception("engine step failed")
            for item in scheduled:
                self._finish(item.seq, "error", f"engine error: {type(exc).__name__}: {exc}")
            return None
        finally:
            self.kv.pending_copies = []
        for item in scheduled:
            self.kv.commit(item.seq, item.num_tokens)
        return logits

    def _sample(self, scheduled: list[ScheduledSeq], logits: torch.Tensor) -> list[tuple[Sequence, int]]:
        """The next token of every sequence whose end this step reached (logits has one row for each)."""
        rows: list[int] = []
        samples: list[Sequence] = []
        for row, seq in enumerate(item.seq for item in scheduled if item.samples):
            for each in self._samples_of(seq):
                rows.append(row)
                samples.append(each)
        if not samples:
            return []
        # each row sampled once is the common case: logits as they are, no copy (a fresh one faults its pages in);
        # the forward's inference tensors, which the sampler may change in place (bans, penalties)
        picked = logits if len(rows) == logits.shape[0] else logits[rows]
        with torch.inference_mode():
            return list(zip(samples, sample(picked, samples, self.eos_token_ids)))

    def _samples_of(self, seq: Sequence) -> list[Sequence]:
        """The samples that seq's logits row stands for: at a request's first token (n > 1), its other
        samples fork from it, sharing the prompt's blocks."""
        group = self.groups[seq.request_id]
        if len(group) == seq.params.n:
            return [seq]
        group += [self._fork(seq, sample_id(seq.request_id, i), seq.request_id, i, None) for i in range(1, seq.params.n)]
        return group

    def _commit(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        seq.new_token_ids.append(token)
        added = detokenizer.detokenize_step(self.tokenizer, seq)
        seq.text += added
        seq.new_text += added
        params = seq.params
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            self._finish(seq, "stop")
        elif params.stop_strings and (at := stop_string_at(seq.text, len(added), params.stop_strings)) is not None:
            seq.cut_text(at)
            self._finish(seq, "stop", flush=False)
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            self._finish(seq, "length")
        elif len(seq) >= seq.max_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, flush: bool = True) -> None:
        if flush:
            tail = detokenizer.flush(self.tokenizer, seq)
            seq.text += tail
            seq.new_text += tail
        seq.finish_reason, seq.error = reason, error
        self.scheduler.remove(seq)
        group = self.groups[seq.request_id]
        self._owed[id(group)] = group
        if seq.keep and reason != "error":
            self.scheduler.park(seq)
        else:
            if seq.block_table:
                self.kv.free(seq)
            seq.status = Status.FINISHED

    def _report(self, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
        """The outputs of the requests that moved; a request that finished without keep is then forgotten."""
        moved, self._owed = self._owed, {}
        for item in scheduled:
            group = self.groups[item.seq.request_id]
            moved[id(group)] = group
        outputs = [self._output(group) for group in moved.values()]
        for group in moved.values():
            request_id = group[0].request_id
            if self.groups.get(request_id) is group and all(s.status is Status.FINISHED and not s.keep for s in group):
                del self.groups[request_id]
        return outputs

    @staticmethod
    def _output(group: list[Sequence]) -> RequestOutput:
        outputs = []
        for seq in group:
            outputs.append(CompletionOutput(
                seq.index, seq.output_token_ids, seq.text, seq.new_token_ids, seq.new_text, seq.finish_reason, seq.error,
            ))
            seq.new_token_ids, seq.new_text = [], ""
        first = group[0]
        # A request with n > 1 forks its other samples at its first token: until then, first is all of it.
        finished = all(seq.finish_reason is not None for seq in group)
        return RequestOutput(first.request_id, first.token_ids[: first.turn_start], outputs, finished,
                             first.num_cached_tokens)

    def _trim_rate(self, now: float) -> None:
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()

    # ---- the picture ----------------------------------------------------------------------------

    def kv_snapshot(self) -> KVSnapshot:
        """The pool and every request the engine knows (whose id is in use); one forgotten at the last
        step shows only in that step's events."""
        seqs = [seq for group in self.groups.values() for seq in group]
        owners: dict[int, list[str]] = {}
        for seq in seqs:
            for block_id in seq.block_table:
                owners.setdefault(block_id, []).append(seq.seq_id)
        blocks = tuple(
            BlockInfo(b.block_id, b.ref_count, len(b.token_ids), tuple(owners.get(b.block_id, ())),
                      b.ref_count == 0 and b.block_hash is not None, b.block_hash, tuple(b.token_ids))
            for b in self.pool.blocks
        )
        # The list holds the sequences it names, so no id here is a recycled one. A sequence freed since
        # the step (released, closed, failed) computed less than it had: the step's work is gone.
        starts = {id(item.seq): item.start for item in self._last_step}
        requests = tuple(
            RequestInfo(seq.request_id, seq.seq_id, seq.status.value, tuple(seq.block_table), len(seq),
                        seq.num_computed_tokens, seq.num_cached_tokens, seq.max_len,
                        min(starts.get(id(seq), seq.num_computed_tokens), seq.num_computed_tokens))
            for seq in seqs
        )
        self._trim_rate(time.perf_counter())
        other = torch.bfloat16 if kv_quant.is_quantized(self.runner.kv_cache_dtype) else torch.int8
        return KVSnapshot(
            step=self.step_count,
            num_blocks=self.pool.num_blocks,
            block_size=self.pool.block_size,
            num_free_blocks=self.pool.num_free,
            num_cached_blocks=self.pool.num_cached_free,
            blocks=blocks,
            requests=requests,
            block_tables=MappingProxyType({r.seq_id: r.block_table for r in requests}),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_parked=len(self.scheduler.parked),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            tokens_per_second=sum(n for _, n in self._rate) / RATE_WINDOW_S,
            events=tuple(self.pool.events),
            kv_cache_dtype=kv_quant.NAMES[self.runner.kv_cache_dtype],
            bytes_per_block=self.runner.bytes_per_block,
            other_kv_cache_dtype=kv_quant.NAMES[other],
            other_num_blocks=self.pool.num_blocks * self.runner.bytes_per_block // self.runner.layout.bytes_per_block(
                self.pool.block_size, other),
            weights_format=self.runner.plan.weights_format,
            weights_bytes=self.config.weights_bytes,
        )

    def block_scales(self, block_id: int, num_tokens: int) -> tuple[tuple[float, float], tuple[float, float]] | None:
        """The smallest and largest scale of a block's first `num_tokens` slots, (keys, values), over every layer
        and KV head; None for a cache without scales, or an empty block. It reads the cache alone, so another
        thread may ask while a step runs (the numbers are then a moment's)."""
        if not kv_quant.is_quantized(self.runner.kv_cache_dtype) or num_tokens == 0:
            return None
        keys, values = (torch.stack([kv_quant.scales(cache[i][block_id, :num_tokens]) for cache in self.runner.kv_caches])
                        for i in (0, 1))
        return (keys.min().item(), keys.max().item()), (values.min().item(), values.max().item())


def stop_string_at(text: str, num_added: int, stop_strings: tuple[str, ...]) -> int | None:
    """Where the first stop string that the last num_added characters completed begins in text."""
    for stop in stop_strings:
        at = text.find(stop, max(0, len(text) - num_added - len(stop) + 1))
        if at >= 0:
            return at
    return None


def _eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (model.generation_config.eos_token_id, model.config.eos_token_id, tokenizer.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, list) else [source])
    return ids
