"""What the last step touched in the KV cache: per request, the blocks attention read and the slots
that received the new tokens' K/V (from `RequestInfo.num_computed_before_step`)."""

from dataclasses import dataclass
from typing import Literal

from pagedchat.engine.api.snapshot import KVSnapshot, RequestInfo

Mark = Literal["read", "written"]


@dataclass(frozen=True, slots=True)
class StepTouch:
    read: tuple[int, ...]  # block ids: every block of the context, the new tokens' included
    written: tuple[tuple[int, int, int], ...]  # (block id, first slot, last slot) of the new K/V, in order


def step_touch(info: RequestInfo, block_size: int) -> StepTouch | None:
    """What the last step did with one request's blocks; None if it did not run it."""
    before, after = info.num_computed_before_step, info.num_computed_tokens
    if before >= after:
        return None
    end = -(-after // block_size)
    written = tuple((info.block_table[i], max(before - i * block_size, 0), min(after - i * block_size, block_size) - 1)
                    for i in range(before // block_size, end))
    return StepTouch(info.block_table[:end], written)


def step_marks(snapshot: KVSnapshot) -> dict[int, Mark]:
    """Each block the last step touched, by id: "written" if any of its slots got K/V, else "read"."""
    touches = [t for info in snapshot.requests if (t := step_touch(info, snapshot.block_size)) is not None]
    marks: dict[int, Mark] = {block_id: "read" for t in touches for block_id in t.read}
    return marks | {block_id: "written" for t in touches for block_id, _, _ in t.written}
