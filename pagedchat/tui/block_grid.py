"""The block grid: one cell per physical KV block, drawn from a KVSnapshot with the line API.

Drawing is the hot path of the panel (a new snapshot every step while generating), so the grid keeps
one key per row describing what that row shows, refreshes only rows whose key changed, and caches
the `Strip` of each key. A 1,024-block pool costs a comparison of 40-odd tuples per snapshot.
"""

from collections.abc import Callable

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.cache import LRUCache
from textual.geometry import Offset, Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from pagedchat.engine.api.snapshot import BlockInfo, KVSnapshot
from pagedchat.tui.step_marks import Mark
from pagedchat.tui.themes import SessionTag

CELL_WIDTH = 2  # a glyph and a gap
FILL = " ▁▂▃▄▅▆▇█"  # a block's fill in eighths
# Drawn in the gap after a cell that the last step touched: a glyph over a full block would hide its fill.
MARK_GLYPHS: dict[Mark, str] = {"read": "◃", "written": "◂"}

# A cell as drawn: glyph, foreground, background (colours are theme colours, resolved by name).
Cell = tuple[str, str, str | None]


def cell_for(block: BlockInfo, block_size: int, tag_of: Callable[[str], SessionTag]) -> Cell:
    """How one block looks. Owned blocks take their session's colour and show their fill; a shared
    block shows its ref count on that colour; free blocks are dots, cached-free blocks are shaded."""
    if block.ref_count == 0:
        return ("░", "block-cached", None) if block.cached else ("·", "block-free", None)
    colour = tag_of(block.owners[0]).variable if block.owners else "block-cached"
    if block.ref_count > 1:
        return (str(block.ref_count) if block.ref_count < 10 else "+", "block-shared", colour)
    eighths = max(1, -(-block.num_tokens * 8 // block_size)) if block.num_tokens else 1
    return FILL[eighths], colour, None


class BlockGrid(ScrollView, can_focus=True):
    """The physical block pool; the cursor selects a block for the detail view.

    | Key | Description |
    | :- | :- |
    | left/right | Previous/next block. |
    | up/down | The block one row up/down. |
    | home/end | First/last block. |

    While the engine is paused or in slow motion the panel passes the last step's marks: the gap after
    a block it read or wrote shows MARK_GLYPHS, styled by the component classes.
    """

    COMPONENT_CLASSES = {"block-grid--read", "block-grid--written"}

    BINDINGS: list[BindingType] = [
        Binding("left", "move(-1)", "Previous block", show=False),
        Binding("right", "move(1)", "Next block", show=False),
        Binding("up", "move_rows(-1)", "Row up", show=False),
        Binding("down", "move_rows(1)", "Row down", show=False),
        Binding("home", "move_to(0)", "First block", show=False),
        Binding("end", "move_to(-1)", "Last block", show=False),
    ]

    DEFAULT_CSS = """
    BlockGrid {
        height: auto;
        max-height: 45%;  /* of the panel: on a short screen the grid scrolls, and the tables below stay */
        background: $surface;
        scrollbar-size-vertical: 1;
        color: $text-muted;
    }
    BlockGrid:focus {
        background-tint: $foreground 5%;
    }
    BlockGrid > .block-grid--read {
        color: $text-muted;
    }
    BlockGrid > .block-grid--written {
        color: $warning;
        text-style: bold;
    }
    """

    cursor: reactive[int | None] = reactive(None, init=False)
    """The selected block id, or None before the user selects one."""

    class Selected(Message):
        """The user selected a block (click or keys)."""

        def __init__(self, grid: "BlockGrid", block_id: int) -> None:
            super().__init__()
            self.grid = grid
            self.block_id = block_id

        @property
        def control(self) -> "BlockGrid":
            return self.grid

    def __init__(self, *, name: str | None = None, id: str | None = None, classes: str | None = None):
        super().__init__(name=name, id=id, classes=classes)
        self._cells: list[Cell] = []
        self.marks: dict[int, Mark] = {}  # what the last step touched, when the panel shows it
        self._row_keys: list[tuple] = []
        self._columns = 1
        self._tag_of: Callable[[str], SessionTag] = SessionTag.fallback
        self._strips: LRUCache[tuple, Strip] = LRUCache(1024)
        self._styles: dict[tuple[str, str | None, bool], Style] = {}

    # -- data --------------------------------------------------------------------------------------

    def show(self, snapshot: KVSnapshot, tag_of: Callable[[str], SessionTag], marks: dict[int, Mark]) -> None:
        """Draw this snapshot with these step marks; only rows that look different are refreshed."""
        self._tag_of = tag_of
        self.marks = marks
        self._cells = [cell_for(block, snapshot.block_size, tag_of) for block in snapshot.blocks]
        if self.cursor is not None and self.cursor >= len(self._cells):
            self.cursor = None
        self._relayout(refresh_all=False)

    def _relayout(self, refresh_all: bool) -> None:
        width = self.scrollable_content_region.width or self.size.width
        self._columns = max(1, (width - self._gutter) // CELL_WIDTH)
        rows = -(-len(self._cells) // self._columns)
        old_keys = self._row_keys
        self._row_keys = [self._row_key(row) for row in range(rows)]
        if Size(width, rows) != self.virtual_size:
            self.virtual_size = Size(width, rows)
            refresh_all = True
        if refresh_all or len(old_keys) != rows:
            self.refresh()
            return
        for row, (old, new) in enumerate(zip(old_keys, self._row_keys)):
            if old != new:
                self.refresh_line(row)

    def cell_offset(self, block_id: int) -> Offset:
        """Where a block's cell is drawn, in the grid's content as scrolled now (what a click there gives)."""
        row, column = divmod(block_id, self._columns)
        return Offset(self._gutter + column * CELL_WIDTH, row - self.scroll_offset.y)

    @property
    def _gutter(self) -> int:
        """Room for the id of each row's first block, so a presenter can say "block 37"."""
        return len(str(max(0, len(self._cells) - 1))) + 1

    def _row_key(self, row: int) -> tuple:
        start = row * self._columns
        cursor = self.cursor - start if self.cursor is not None else None
        end = start + self._columns
        marks = tuple(self.marks.get(block_id) for block_id in range(start, end)) if self.marks else ()
        return start, tuple(self._cells[start:end]), marks, cursor

    # -- drawing -----------------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        row = y + self.scroll_offset.y
        width = self.size.width
        if row >= len(self._row_keys):
            return Strip.blank(width, self.rich_style)
        key = (self._row_keys[row], width, self.rich_style, self.app.theme)
        strip = self._strips.get(key)
        if strip is None:
            strip = self._strips[key] = self._render_row(self._row_keys[row], width)
        return strip

    def _render_row(self, row_key: tuple, width: int) -> Strip:
        start, cells, marks, cursor = row_key
        base = self.rich_style
        segments = [Segment(f"{start:>{self._gutter - 1}} ", base + Style(dim=True))]
        for i, (glyph, fg, bg) in enumerate(cells):
            segments.append(Segment(glyph, base + self._style(fg, bg, i == cursor)))
            mark = marks[i] if marks else None
            segments.append(Segment(MARK_GLYPHS[mark], base + self.mark_style(mark)) if mark else Segment(" ", base))
        return Strip(segments).adjust_cell_length(width, base)

    def mark_style(self, mark: Mark) -> Style:
        return self.get_component_rich_style(f"block-grid--{mark}", partial=True)  # Textual caches it

    def _style(self, fg: str, bg: str | None, selected: bool) -> Style:
        key = (fg, bg, selected)
        style = self._styles.get(key)
        if style is None:
            colours = self.app.theme_variables
            style = Style(color=colours[fg], bgcolor=colours[bg] if bg else None, bold=bg is not None)
            if selected:
                style += Style(reverse=True, underline=True)
            self._styles[key] = style
        return style

    def on_resize(self) -> None:
        self._relayout(refresh_all=True)

    def on_mount(self) -> None:
        self.watch(self.app, "theme", self._theme_changed, init=False)

    def _theme_changed(self) -> None:
        self._styles.clear()
        self.refresh()

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        columns = max(1, (width - self._gutter) // CELL_WIDTH)
        return -(-len(self._cells) // columns)

    # -- selection ---------------------------------------------------------------------------------

    def watch_cursor(self, old: int | None, new: int | None) -> None:
        for block_id in (old, new):
            if block_id is not None and block_id < len(self._cells):
                row = block_id // self._columns
                if row < len(self._row_keys):
                    self._row_keys[row] = self._row_key(row)
                    self.refresh_line(row)
        if new is not None:
            self.scroll_to_region(Region(0, new // self._columns, 1, 1), animate=False)
            self.post_message(self.Selected(self, new))

    def _select(self, block_id: int) -> None:
        if self._cells:
            self.cursor = max(0, min(block_id, len(self._cells) - 1))

    def action_move(self, delta: int) -> None:
        self._select(0 if self.cursor is None else self.cursor + delta)

    def action_move_rows(self, rows: int) -> None:
        self.action_move(rows * self._columns)

    def action_move_to(self, block_id: int) -> None:
        self._select(block_id if block_id >= 0 else len(self._cells) - 1)

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.x < self._gutter:
            return
        column = (offset.x - self._gutter) // CELL_WIDTH
        block_id = (offset.y + self.scroll_offset.y) * self._columns + column
        if column < self._columns and block_id < len(self._cells):
            self.focus()
            self.cursor = block_id
