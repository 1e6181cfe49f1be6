"""Each session's block table: logical block i lives in physical block table[i]."""

from collections.abc import Callable

from rich.text import Text

from pagedchat.engine.snapshot import KVSnapshot
from pagedchat.tui.text_panel import TextPanel
from pagedchat.tui.themes import SessionTag

EMPTY = "no block tables yet"


class BlockTables(TextPanel):
    """One line per live request, in its session's colour; shared entries are underlined. A line
    that does not fit ends in an ellipsis: the height follows the number of requests only."""

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

    def show(self, snapshot: KVSnapshot, tag_of: Callable[[str], SessionTag]) -> None:
        live = [info for info in snapshot.requests if info.status != "finished"]
        shared = {b.block_id for b in snapshot.blocks if b.ref_count > 1}
        key = (self.app.theme, tuple((info, tag_of(info.request_id)) for info in live), frozenset(shared))
        if key == self._key:
            return
        self._key = key
        colours = self.app.theme_variables
        text = Text(no_wrap=True, overflow="ellipsis")
        for info in live:
            tag = tag_of(info.request_id)
            colour = colours[tag.variable]
            text.append("■ ", style=colour)
            text.append(f"{tag.name}", style=f"bold {colour}")
            text.append(f" {info.status} · {info.num_tokens} tok · {len(info.block_table)} blocks:")
            for block_id in info.block_table:
                text.append(" ")
                text.append(str(block_id), style=f"{colour} underline" if block_id in shared else colour)
            text.append("\n")
        text.rstrip()
        self.set_text(text or Text(EMPTY))
