from dataclasses import dataclass, field
from enum import Enum

import torch

from pagedchat.engine.api.params import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    PARKED = "parked"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample of a request: its token ids across all turns, its block table and its current turn's output."""

    seq_id: str
    request_id: str  # the parent request whose RequestOutput carries this sample
    index: int
    token_ids: list[int]
    params: SamplingParams
    max_len: int
    keep: bool = False
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full block of token_ids
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    turn_start: int = 0  # index of this turn's first generated token
    queued_at: int = 0  # the step at which this turn joined the waiting queue (a preemption keeps it)
    admitted_at: int = 0  # the step at which it last left it to run
    passed_due: bool = False  # it was admitted ahead of a due request (scheduler.py)
    generator: torch.Generator | None = None
    # This turn's output, streamed.
    text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.turn_start

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.turn_start :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def cut_text(self, at: int) -> None:
        """End this turn's text at `at` (a stop string begins there); what this step added loses the same tail."""
        cut = len(self.text) - at
        self.text = self.text[:at]
        self.new_text = self.new_text[: max(0, len(self.new_text) - cut)]

    def start_turn(self, new_token_ids: list[int], params: SamplingParams) -> None:
        self.token_ids.extend(new_token_ids)
        self.turn_start = len(self.token_ids)
        self.params = params
        self.text = self.new_text = ""
        self.new_token_ids = []
        self.prefix_offset = self.read_offset = 0
        self.finish_reason = self.error = None
        self.generator = make_generator(params.seed, self.index)


def make_generator(seed: int | None, index: int) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed + index)
    return generator
