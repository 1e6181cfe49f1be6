"""The same sessions laid out contiguously: what a reserve-the-maximum allocator would hold.

A model, drawn beside the paged grid from the same KVSnapshot (f9 shows or hides it). Each live
request, in arrival order (the snapshot's order), reserves ceil(max_len / block_size) contiguous
blocks, first fit in a pool of `num_blocks`; one that does not fit is refused, where paging serves it.
The numbers beside are paging's real ones: the blocks the engine holds now.
"""

from collections.abc import Callable
from dataclasses import dataclass

from rich.text import Text

from pagedchat.engine.api.snapshot import KVSnapshot
from pagedchat.tui.kv_stats import LIVE, contiguous_blocks
from pagedchat.tui.text_panel import TextPanel
from pagedchat.tui.themes import SessionTag

MODEL_LABEL = "a model: contiguous reservation, first-fit in arrival order"
BAR_WIDTH = 48  # cells of the pool bar; each stands for num_blocks / BAR_WIDTH blocks
LISTED = 6  # sessions named one a line; the rest are counted


@dataclass(frozen=True, slots=True)
class Reservation:
    request_id: str
    reserved: int  # ceil(max_len / block_size): the blocks it asks for
    used: int  # ceil(num_tokens / block_size), at most `reserved`
    start: int | None  # its first block in the pool; None when refused


@dataclass(frozen=True, slots=True)
class ContiguousModel:
    num_blocks: int
    placed: tuple[Reservation, ...]  # in pool order = arrival order (nothing is ever freed)
    refused: tuple[Reservation, ...]
    asked: int  # blocks all live requests ask for, placed or refused
    reserved: int  # blocks held by the placed reservations
    used: int  # of those, blocks holding tokens
    internal: int  # reserved - used: waste inside reservations
    free: int  # blocks no reservation holds
    external: int  # free blocks in runs too small for any refused request (0 when none is refused)


def first_fit(num_blocks: int, asks: list[tuple[str, int, int]]) -> tuple[list[Reservation], list[Reservation]]:
    """Place (request_id, reserved, used) asks in order, each in the first free run long enough.
    Returns (placed, refused)."""
    runs = [(0, num_blocks)] if num_blocks > 0 else []  # free runs (start, length), in pool order
    placed, refused = [], []
    for request_id, reserved, used in asks:
        for i, (start, length) in enumerate(runs):
            if length >= reserved:
                placed.append(Reservation(request_id, reserved, used, start))
                runs[i] = (start + reserved, length - reserved)
                if runs[i][1] == 0:
                    del runs[i]
                break
        else:
            refused.append(Reservation(request_id, reserved, used, None))
    return placed, refused


def contiguous_model(snapshot: KVSnapshot) -> ContiguousModel:
    """What a contiguous allocator would hold for the snapshot's live requests (a model, not a measure).

    Each live request in arrival order reserves ceil(max_len / block_size) contiguous blocks, first
    fit; one that fits in no free run is refused. Used = ceil(num_tokens / block_size) of its
    reservation; internal waste = reserved - used; external waste = free blocks in runs shorter than
    the smallest refused reservation (they can serve none of the refused), 0 when none is refused:
    then the free blocks are just free. Since the model never frees, its free space is one run at the
    end of the pool, and with a refusal all of it is external waste.
    """
    size = snapshot.block_size
    asks = [(info.request_id, -(-info.max_len // size), -(-info.num_tokens // size))
            for info in snapshot.requests if info.status in LIVE]
    asks = [(rid, reserved, min(used, reserved)) for rid, reserved, used in asks]
    placed, refused = first_fit(snapshot.num_blocks, asks)
    reserved = sum(r.reserved for r in placed)
    used = sum(r.used for r in placed)
    # The free runs left: the gaps between placed reservations and after the last one.
    runs, edge = [], 0
    for r in sorted(placed, key=lambda r: r.start):
        if r.start > edge:
            runs.append(r.start - edge)
        edge = r.start + r.reserved
    if snapshot.num_blocks > edge:
        runs.append(snapshot.num_blocks - edge)
    smallest = min((r.reserved for r in refused), default=None)
    external = sum(n for n in runs if n < smallest) if smallest is not None else 0
    return ContiguousModel(snapshot.num_blocks, tuple(placed), tuple(refused), contiguous_blocks(snapshot),
                           reserved, used, reserved - used, snapshot.num_blocks - reserved, external)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "0%"


def bar_text(model: ContiguousModel, colours: dict[str, str], tag_of: Callable[[str], SessionTag],
             width: int = BAR_WIDTH) -> Text:
    """The pool in `width` cells: a reservation's used part █ and its unused part ░ in its session's
    colour, free blocks ·. A cell shows the block at its middle."""
    text = Text()
    n = model.num_blocks
    if n == 0:
        return text
    width = min(width, n)
    owner = [None] * n  # (reservation, used?) per block
    for r in model.placed:
        for b in range(r.start, r.start + r.reserved):
            owner[b] = (r, b - r.start < r.used)
    for cell in range(width):
        block = (2 * cell + 1) * n // (2 * width)
        held = owner[block]
        if held is None:
            text.append("·", style=colours.get("block-free", ""))
        else:
            r, is_used = held
            text.append("█" if is_used else "░", style=colours.get(tag_of(r.request_id).variable, ""))
    return text


def contiguous_text(snapshot: KVSnapshot, colours: dict[str, str],
                    tag_of: Callable[[str], SessionTag] = SessionTag.fallback) -> Text:
    model = contiguous_model(snapshot)
    n = model.num_blocks
    text = Text()
    text.append("contiguous", style="bold")
    first, rest = MODEL_LABEL.split(", ", 1)  # the label on two lines: one is wider than the panel
    text.append(f" · {first},\n{rest}\n", style="italic")
    text.append_text(bar_text(model, colours, tag_of))
    text.append("\n")
    live = len(model.placed) + len(model.refused)
    text.append(f"asked    {model.asked:>5} blocks for {live} live\n")
    text.append(f"reserved {model.reserved:>5} ({_pct(model.reserved, n):>4})  "
                f"used {model.used:>5} ({_pct(model.used, n):>4})\n")
    text.append(f"internal {model.internal:>5} ({_pct(model.internal, n):>4})  "
                f"in reservations, unused\n")
    if model.refused:
        text.append(f"external {model.external:>5} ({_pct(model.external, n):>4})  "
                    f"free, too small for the refused\n")
        text.append(f"refused  {len(model.refused):>5} of {live} live: paging serves them\n", style="bold")
    else:
        text.append(f"free     {model.free:>5} ({_pct(model.free, n):>4})  none refused\n")
    held = snapshot.num_blocks - snapshot.num_free_blocks
    text.append(f"paging holds {held:>5} ({_pct(held, n):>4}) for all {live} live, refuses 0", style="bold")
    for r in (model.placed + model.refused)[:LISTED]:
        tag = tag_of(r.request_id)
        text.append("\n")
        text.append("■ ", style=colours.get(tag.variable, ""))
        where = f"blocks {r.start}-{r.start + r.reserved - 1}" if r.start is not None else "refused"
        text.append(f"{tag.name:<14} {r.used:>4}/{r.reserved:<4} used · {where}")
    if live > LISTED:
        text.append(f"\n+{live - LISTED} more")
    return text


class ContiguousView(TextPanel):
    """The live sessions as a contiguous allocator would hold them: a bar of the pool and the numbers.
    Hidden by default; while hidden it keeps the last snapshot and draws it when shown."""

    DEFAULT_CSS = """
    ContiguousView {
        height: auto;
        padding: 0 1;
        border-top: hkey $panel;
        display: none;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__("", **kwargs)
        self._snapshot: KVSnapshot | None = None
        self._tag_of: Callable[[str], SessionTag] = SessionTag.fallback

    def show(self, snapshot: KVSnapshot, tag_of: Callable[[str], SessionTag] | None = None) -> None:
        self._snapshot = snapshot
        self._tag_of = tag_of or self._tag_of
        if self.display:
            self._draw()

    def toggle(self) -> bool:
        """Show or hide the view; returns whether it is shown now."""
        self.display = not self.display
        if self.display:
            self._draw()
        return self.display

    def _draw(self) -> None:
        if self._snapshot is not None:
            self.set_text(contiguous_text(self._snapshot, self.app.theme_variables, self._tag_of))
