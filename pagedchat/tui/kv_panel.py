"""The KV panel: everything it draws comes from one KVSnapshot, so a hand-made one tests it."""

from collections.abc import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from pagedchat.engine.api.snapshot import KVSnapshot
from pagedchat.tui.block_detail import BlockDetail, Scales
from pagedchat.tui.block_grid import MARK_GLYPHS, BlockGrid
from pagedchat.tui.block_tables import BlockTables
from pagedchat.tui.contiguous_view import ContiguousView
from pagedchat.tui.event_log import EventLog
from pagedchat.tui.kv_stats import KVStats
from pagedchat.tui.step_marks import step_marks
from pagedchat.tui.themes import SessionTag


def legend_text(colours: dict[str, str], grid: BlockGrid | None = None) -> Text:
    """The grid's glyphs; with `grid`, a second line for its step marks, in its styles."""
    text = Text()
    for glyph, style, label in (("█", colours["session-0"], "in use"),
                                ("▄", colours["session-0"], "partial"),
                                ("2", f"bold {colours['block-shared']} on {colours['session-0']}", "shared by 2"),
                                ("░", colours["block-cached"], "cached"),
                                ("·", colours["block-free"], "free")):
        text.append(glyph, style=style)
        text.append(f" {label}  ")
    text.rstrip()
    if grid is not None:
        text.append("\nlast step:")
        for mark, label in (("written", "wrote slots in it"), ("read", "read it")):
            text.append("  █", style=colours["session-0"])
            text.append(MARK_GLYPHS[mark], style=grid.mark_style(mark))
            text.append(f" {label}")
    return text


class KVPanel(Vertical):
    DEFAULT_CSS = """
    KVPanel {
        width: 58;
        height: 1fr;
        border-left: vkey $panel;
        background: $surface;
    }
    KVPanel > #legend {
        padding: 0 1;
        height: auto;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.snapshot: KVSnapshot | None = None
        self.step_marks_on = False  # mark what the last step read and wrote (set_step_marks)
        self._tag_of: Callable[[str], SessionTag] = SessionTag.fallback
        self._decode: Callable[[list[int]], str] = lambda ids: " ".join(map(str, ids))
        self._scales: Callable[[int, int], Scales | None] | None = None

    def compose(self) -> ComposeResult:
        yield KVStats("waiting for the engine…")
        yield BlockGrid()
        yield Static(id="legend")
        yield ContiguousView()  # hidden until toggle_contiguous (f9)
        yield BlockDetail()
        yield BlockTables()
        yield EventLog()

    def on_mount(self) -> None:
        self._redraw()
        # Not a watch of app.theme: the legend's step marks take the grid's CSS, which changes after it.
        self.app.theme_changed_signal.subscribe(self, lambda _theme: self._redraw())

    def show(self, snapshot: KVSnapshot, tag_of: Callable[[str], SessionTag] | None = None,
             decode: Callable[[list[int]], str] | None = None,
             scales: Callable[[int, int], Scales | None] | None = None) -> None:
        """Draw a snapshot. `tag_of` names and colours request ids; `decode` turns tokens to text; `scales` gives
        an 8-bit block's scales from its id and filled slots (a local engine's: the snapshot does not hold them)."""
        self.snapshot = snapshot
        self._tag_of = tag_of or self._tag_of
        self._decode = decode or self._decode
        self._scales = scales or self._scales
        self.query_one(KVStats).show(snapshot)
        self.query_one(BlockGrid).show(snapshot, self._tag_of, step_marks(snapshot) if self.step_marks_on else {})
        self.query_one(ContiguousView).show(snapshot, self._tag_of)
        self.query_one(BlockTables).show(snapshot, self._tag_of, self.step_marks_on)
        self.query_one(EventLog).show(snapshot, self._tag_of)
        self._show_detail()

    def set_step_marks(self, on: bool) -> None:
        """Mark the blocks the last step read and the slots it wrote: on while the engine is paused or
        in slow motion, when each step is worth a look (while it runs, the marks would only flicker)."""
        if on != self.step_marks_on:
            self.step_marks_on = on
            self._redraw()

    def toggle_contiguous(self) -> bool:
        """Show or hide the contiguous-allocation view beside the grid; returns whether it is shown."""
        return self.query_one(ContiguousView).toggle()

    def _show_detail(self) -> None:
        cursor = self.query_one(BlockGrid).cursor
        snapshot = self.snapshot
        block = snapshot.blocks[cursor] if snapshot and cursor is not None else None
        scales = self._scales(block.block_id, block.num_tokens) if block is not None and self._scales else None
        self.query_one(BlockDetail).show(block, snapshot.block_size if snapshot else 0,
                                         self._tag_of, self._decode, scales)

    def on_block_grid_selected(self) -> None:
        self._show_detail()

    def _redraw(self) -> None:
        marked = self.query_one(BlockGrid) if self.step_marks_on else None
        self.query_one("#legend", Static).update(legend_text(self.app.theme_variables, marked))
        if self.snapshot is not None:
            self.show(self.snapshot)
