from collections import deque
from dataclasses import dataclass, field

from pagedchat.engine.core.kv_manager import KVCacheManager
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


class Scheduler:
    """One step's work: running sequences first, then waiting ones, within a token budget and a sequence cap.

    There are no prefill and decode phases: every sequence gets the tokens it still needs (a long prompt
    in chunks). When the pool runs dry, parked conversations are released first (least recently used),
    then the newest running sequence is preempted and goes back to the front of the queue.
    """

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: dict[str, Sequence] = {}  # least recently used first
        self.num_preemptions = 0

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        for seq in list(self.running):
            if budget == 0 or len(scheduled) == self.max_num_seqs:  # forks join running past the cap
                break
            if seq.status is not Status.RUNNING:  # preempted by an earlier sequence of this loop
                continue
            num_tokens = min(seq.num_uncomputed, budget)
            while not self.kv.allocate(seq, num_tokens):
                if self._reclaim(exclude=seq):
                    continue
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, num_tokens))
                budget -= num_tokens

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.kv.cached_prefix(seq)
            num_tokens = min(len(seq) - seq.num_computed_tokens - len(cached) * self.kv.block_size, budget)
            while not self.kv.allocate(seq, num_tokens, cached):
                if not self._reclaim(exclude=seq):
                    return scheduled
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
        return scheduled

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
