from collections import deque
from dataclasses import dataclass, field

from pagedchat.engine.core.kv_manager import KVCacheManager, cdiv
from pagedchat.engine.core.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step
    samples: bool = False  # this step reaches the end of the sequence, so its last position is sampled
    start: int = field(init=False)  # tokens computed before this step's: its cached prefix included

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


MAX_WAIT_STEPS = 64  # a request queued this long is due; one admitted this long may yield to it


class Scheduler:
    """One step's work: running sequences first, then waiting ones, within a token budget and a sequence cap.

    There are no prefill and decode phases: every sequence gets the tokens it still needs (a long prompt
    in chunks). When the pool runs dry, parked conversations are released first (least recently used),
    then the running sequence whose turn came last is preempted and goes back to the front of the queue.

    Waiting requests go first come, first served, but one that needs more blocks than the pool can
    give now does not hold up those behind it that fit (a conversation as large as the pool would
    otherwise stop every other tab): they go ahead. Once its turn was queued MAX_WAIT_STEPS ago (a
    preemption does not restart that count) it is due, the oldest first, and if it cannot fit, running
    requests are preempted for it, the largest first, provided that makes room: those admitted past it
    while it was due, and those that have run MAX_WAIT_STEPS holding at least twice the blocks it
    needs. So a conversation that fills the pool yields to short ones after MAX_WAIT_STEPS, while
    conversations of a size wait for each other's reply (preempting one for the other would only
    recompute it), and free blocks are not left idle meanwhile. A request is admitted only where the
    running ones can still grow for a while (`_reserve`), or once due.
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: dict[str, Sequence] = {}  # least recently used first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        seq.queued_at = self.kv.pool.step
        self.waiting.append(seq)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        # The oldest turn first (a preempted request sits at the queue's front, whatever its age).
        due = sorted((seq for seq in self.waiting if self._since(seq.queued_at) >= MAX_WAIT_STEPS),
                     key=lambda seq: seq.queued_at)
        if due:
            # Before the running ones are scheduled: a victim must not be in this step's batch.
            self._make_room(due[0])
        # The oldest turn first, and the newest is preempted when the pool runs dry (vLLM's order): a
        # victim comes later in this loop, so it is never one this step already scheduled.
        for seq in sorted(self.running, key=lambda seq: seq.queued_at):
            if budget == 0 or len(scheduled) == self.max_num_seqs:  # forks join running past the cap
                break
            if seq.status is not Status.RUNNING:  # preempted by an earlier sequence of this loop
                continue
            num_tokens = min(seq.num_uncomputed, budget)
            while not self.kv.allocate(seq, num_tokens):
                if self._reclaim(exclude=seq):
                    continue
                victim = max(reversed(self.running), key=lambda seq: seq.queued_at)
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, num_tokens))
                budget -= num_tokens

        passing = False  # a due request did not fit: those admitted now pass it
        for seq in due + [seq for seq in self.waiting if seq not in due]:
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            num_tokens = self._admit(seq, budget, passing and seq not in due, self._reserve(seq, due))
            if num_tokens is None:
                passing = passing or seq in due
                continue
            scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
        return scheduled

    def _admit(self, seq: Sequence, budget: int, passing: bool, reserve: int) -> int | None:
        """Move seq from waiting to running with the blocks for its next chunk (reclaiming idle blocks if
        need be), leaving `reserve` blocks free: the chunk's tokens, or None if it does not fit.
        `passing`: it goes ahead of a due request, which may preempt it at once."""
        cached, num_tokens = self._next_chunk(seq, budget)
        while (self.kv.blocks_needed(seq, num_tokens, cached) + reserve > self.kv.pool.num_free
               or not self.kv.allocate(seq, num_tokens, cached)):
            if not self._reclaim(exclude=seq):
                return None
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        seq.admitted_at = self.kv.pool.step
        seq.passed_due = passing
        seq.num_cached_tokens = seq.num_computed_tokens
        self.running.append(seq)
        return num_tokens

    def _reserve(self, seq: Sequence, due: list[Sequence]) -> int:
        """Blocks to leave free when admitting seq: none for a due request; else what the running ones
        take in MAX_WAIT_STEPS more tokens (or the rest of their replies), so that their growth does
        not preempt it soon after it came in (and its blocks churn, allocated, evicted, again)."""
        if seq in due:
            return 0
        return sum(min(self._growth(s), cdiv(MAX_WAIT_STEPS, self.kv.block_size)) for s in self.running)

    def _growth(self, seq: Sequence) -> int:
        """The blocks a running seq may still take before its turn ends."""
        left = seq.max_len - len(seq)
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        return max(0, cdiv(len(seq) + left, self.kv.block_size) - len(seq.block_table))

    def _next_chunk(self, seq: Sequence, budget: int) -> tuple[list[int], int]:
        """The prefix cache's blocks for a waiting seq, and the tokens it would compute next."""
        cached = self.kv.cached_prefix(seq)
        return cached, min(len(seq) - seq.num_computed_tokens - len(cached) * self.kv.block_size, budget)

    def _since(self, step: int) -> int:
        return self.kv.pool.step - step

    def _make_room(self, seq: Sequence) -> None:
        """Preempt, the largest first, the running requests that yield to the due seq (see the class),
        if that frees enough blocks (with the free and the idle ones) for its next chunk; else none."""
        cached, num_tokens = self._next_chunk(seq, self.max_num_batched_tokens)
        need = self.kv.blocks_needed(seq, num_tokens, cached)
        idle = [s for s in (*self.parked.values(), *self.waiting) if s is not seq]
        short = need - self.kv.pool.num_free - sum(map(self._own, idle))
        if short <= 0:
            return
        victims = sorted((s for s in self.running if s.passed_due or (
            self._since(s.admitted_at) >= MAX_WAIT_STEPS and self._own(s) >= 2 * need)), key=self._own, reverse=True)
        chosen = []
        for victim in victims:
            if short <= 0:
                break
            chosen.append(victim)
            short -= self._own(victim)
        if short <= 0:
            for victim in chosen:
                self.preempt(victim)

    def _own(self, seq: Sequence) -> int:
        """The blocks that freeing seq would return to the pool: those no other sequence holds."""
        return sum(1 for block_id in seq.block_table if self.kv.pool.blocks[block_id].ref_count == 1)

    def _reclaim(self, exclude: Sequence) -> bool:
        """Free the blocks of one idle sequence: a parked conversation (least recently used first), else a
        continued conversation still waiting its turn (newest first). False when there is none."""
        for seq in self.parked.values():
            if seq.block_table:
                self.release(seq)
                return True
        for seq in reversed(self.waiting):
            if seq.block_table and seq is not exclude:
                self.release(seq)
                return True
        return False

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.pool.record("preempt", None, seq.seq_id)
        self.kv.free(seq)
        seq.status = Status.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def release(self, seq: Sequence) -> None:
        self.kv.pool.record("release", None, seq.seq_id)
        self.kv.free(seq)

    def park(self, seq: Sequence) -> None:
        self.parked.pop(seq.seq_id, None)
        self.parked[seq.seq_id] = seq
        seq.status = Status.PARKED

    def remove(self, seq: Sequence) -> None:
        """Take seq out of whichever queue holds it."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.parked.pop(seq.seq_id, None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
