"""Each session's block table: logical block i lives in physical block table[i]."""

import textwrap
from collections.abc import Callable

from rich.text import Text

from pagedchat.engine.api.snapshot import KVSnapshot, RequestInfo
from pagedchat.tui.step_marks import StepTouch, step_touch
from pagedchat.tui.text_panel import TextPanel, flow
from pagedchat.tui.themes import SessionTag

EMPTY = "no block tables yet"
HOLDING = {  # why a request holds its blocks, as the scheduler treats it (engine/core/scheduler.py)
    "running": "generating; they take turns",
    "parked": "parked; released when needed",
    "waiting": "waiting too",
    "preempted": "waiting too",
}


class BlockTables(TextPanel):
    """One entry per live request, in its session's colour; shared entries are underlined. A table
    longer than a line goes on in lines of its own, indented, so that every block id shows (and its
    heading too, on a narrow panel). Under a request that waits, a line says why (`wait_reason`). With
    the step marks on, the entries the last step wrote are reversed and a line under the table says what
    it read and wrote."""

    DEFAULT_CSS = """
    BlockTables {
        height: auto;
        max-height: 10;
        padding: 0 1;
        border-top: hkey $panel;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(EMPTY, **kwargs)
        self._key: tuple | None = None
        self._shown: tuple[KVSnapshot, Callable[[str], SessionTag], bool] | None = None

    def on_resize(self) -> None:
        if self._shown is not None:  # the lines break at the width
            self.show(*self._shown)

    def show(self, snapshot: KVSnapshot, tag_of: Callable[[str], SessionTag], marked: bool) -> None:
        """`marked`: show what the last step touched."""
        self._shown = snapshot, tag_of, marked
        live = [info for info in snapshot.requests if info.status != "finished"]
        shared = {b.block_id for b in snapshot.blocks if b.ref_count > 1}
        width = self.content_region.width or 1
        key = (self.app.theme, width, tuple((info, tag_of(info.seq_id)) for info in live), frozenset(shared),
               marked, snapshot.block_size, snapshot.num_free_blocks)
        if key == self._key:
            return
        self._key = key
        colours = self.app.theme_variables
        text = Text()
        for info in live:
            tag = tag_of(info.seq_id)  # the sample (#i) of a reply with n > 1
            colour = colours[tag.variable]
            name = Text("■ ", style=colour)
            name.append(tag.name, style=f"bold {colour}")
            touch = step_touch(info, snapshot.block_size) if marked else None
            written = {block_id for block_id, _, _ in touch.written} if touch else set()
            entries = []
            for block_id in info.block_table:
                style = f"{colour} underline" if block_id in shared else colour
                style = f"{style} bold reverse" if block_id in written else style
                entries.append((" ", Text(str(block_id), style=style)))
            # "189 tok, 12 blocks:" rather than "189 tok · 12 blocks:": a heading that fits in 37
            # columns (80x24) leaves the ids a line of their own, and one more table shows.
            words = [("", name), (" ", info.status), (" · ", f"{info.num_tokens} tok"),
                     (", ", f"{len(info.block_table)} blocks:"), *entries]
            text.append_text(flow([words], width, indent="   "))
            text.append("\n")
            if (reason := wait_reason(info, snapshot, tag_of)) is not None:
                # Wrapped here: a TextPanel line does not wrap, and the end of a reason matters.
                for index, part in enumerate(textwrap.wrap(reason, max(20, width - 5))):
                    text.append(f"   {'↳' if index == 0 else ' '} {part}\n", style=colour)
            if touch:
                said = flow([[("", f"   ↳ read {len(touch.read)} blocks"), (" · ", f"wrote {wrote(touch)}")]],
                            width, indent="     ")
                said.stylize(colour)
                text.append_text(said)
                text.append("\n")
        text.rstrip()
        self.set_text(text or Text(EMPTY))


def wait_reason(info: RequestInfo, snapshot: KVSnapshot, tag_of: Callable[[str], SessionTag]) -> str | None:
    """Why a waiting request waits, from the snapshot alone: the blocks it needs against the free ones,
    and who holds the most (the scheduler takes turns with it: engine/core/scheduler.py)."""
    if info.status not in ("waiting", "preempted"):
        return None
    need = -(-info.num_tokens // snapshot.block_size) - len(info.block_table)
    free = snapshot.num_free_blocks
    reason = f"needs {need} block{'s' if need != 1 else ''}, {free} free"
    if need <= free:
        return f"{reason}: it starts when its turn comes"
    holder = max((r for r in snapshot.requests if r.seq_id != info.seq_id), key=lambda r: len(r.block_table),
                 default=None)
    if holder is None or not holder.block_table:
        return reason
    return (f"{reason}: {tag_of(holder.request_id).name} holds {len(holder.block_table)}/{snapshot.num_blocks}, "
            f"{HOLDING.get(holder.status, holder.status)}")


def wrote(touch: StepTouch) -> str:
    """The slots a step wrote, as a presenter says them: "slots 5-7 of block 12"; a chunk over several
    blocks takes a second line."""
    (first, start, _), (last, _, end) = touch.written[0], touch.written[-1]
    if first == last:
        return f"slot {start} of block {first}" if start == end else f"slots {start}-{end} of block {first}"
    count = sum(stop - begin + 1 for _, begin, stop in touch.written)
    return (f"{count} slots in {len(touch.written)} blocks\n"
            f"     from slot {start} of block {first} to slot {end} of block {last}")
