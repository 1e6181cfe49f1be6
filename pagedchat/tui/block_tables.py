"""Each session's block table: logical block i lives in physical block table[i]."""

from collections.abc import Callable

from rich.text import Text

from pagedchat.engine.snapshot import KVSnapshot
from pagedchat.tui.text_panel import TextPanel
from pagedchat.tui.themes import SessionTag

EMPTY = "no block tables yet"


class BlockTables(TextPanel):
    """One entry per live request, in its session's colour; shared entries are underlined. A table
    longer than a line goes on in lines of its own, indented, so that every block id shows."""

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
        self._shown: tuple[KVSnapshot, Callable[[str], SessionTag]] | None = None

    def on_resize(self) -> None:
        if self._shown is not None:  # the lines break at the width
            self.show(*self._shown)

    def show(self, snapshot: KVSnapshot, tag_of: Callable[[str], SessionTag]) -> None:
        self._shown = snapshot, tag_of
        live = [info for info in snapshot.requests if info.status != "finished"]
        shared = {b.block_id for b in snapshot.blocks if b.ref_count > 1}
        width = self.content_region.width or 1
        key = (self.app.theme, width, tuple((info, tag_of(info.request_id)) for info in live), frozenset(shared))
        if key == self._key:
            return
        self._key = key
        colours = self.app.theme_variables
        text = Text()
        for info in live:
            tag = tag_of(info.request_id)
            colour = colours[tag.variable]
            line = Text()
            line.append("■ ", style=colour)
            line.append(f"{tag.name}", style=f"bold {colour}")
            line.append(f" {info.status} · {info.num_tokens} tok · {len(info.block_table)} blocks:")
            for block_id in info.block_table:
                entry = str(block_id)
                if line.cell_len + 1 + len(entry) > width:
                    text.append_text(line)
                    text.append("\n")
                    line = Text("   ")
                line.append(" ")
                line.append(entry, style=f"{colour} underline" if block_id in shared else colour)
            text.append_text(line)
            text.append("\n")
        text.rstrip()
        self.set_text(text or Text(EMPTY))
