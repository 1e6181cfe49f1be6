"""A widget that shows lines of rich Text and updates cheaply.

`Static.update` re-renders every line and asks for a layout of the whole screen on each change;
while replies stream, that was most of the UI's cost. This one draws with the line API: a new text
repaints only the lines that differ (Textual caches the rest), and lays out only when the number of
lines changed. A line does not wrap: one too long for the widget ends in an ellipsis; `flow` breaks
lines of words where a width ends, for the panels that must show every word at 80 columns.
"""

from collections.abc import Iterable, Sequence

from rich.cells import cell_len
from rich.segment import Segment
from rich.text import Text
from textual.geometry import Region, Size
from textual.strip import Strip
from textual.widget import Widget

from pagedchat.tui.textual_private import SizedByLayout

# A word of a line, and the separator before it (" · ", " "), which a line broken before the word drops.
Word = tuple[str, Text | str]


def flow(lines: Iterable[Sequence[Word]], width: int | None = None, indent: str = "  ") -> Text:
    """The lines, each broken before a word that would pass `width` cells (None: never); the words
    broken off go on in lines of their own, indented. A word wider than a line ends in an ellipsis;
    one that holds a line break goes on its own way after it (its first line is what must fit)."""
    out = []
    for words in lines:
        line, fresh = Text(), True  # fresh: nothing on the line yet but its indent
        for separator, word in words:
            word = Text(word) if isinstance(word, str) else word
            first = cell_len(word.plain.split("\n", 1)[0])
            if not fresh and width is not None and line.cell_len + len(separator) + first > width:
                out.append(line)
                line, separator = Text(indent), ""
            line.append(separator)
            line.append_text(word)
            fresh = False
        out.append(line)
    return Text("\n").join(out)


class TextPanel(SizedByLayout, Widget):
    def __init__(self, text: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self._lines = [Text(text)]

    def set_text(self, text: Text) -> None:
        lines = list(text.split("\n", allow_blank=True))
        old, self._lines = self._lines, lines
        if len(lines) != len(old):
            self.refresh(layout=True)
            return
        for y, (before, after) in enumerate(zip(old, lines)):
            if before != after:
                self.refresh(Region(0, y, self.size.width, 1))

    def render(self) -> Text:
        """All of it, as `Static.render` gives it (the drawing goes through `render_line`)."""
        return Text("\n").join(self._lines)

    def get_content_width(self, container: Size, viewport: Size) -> int:
        return max(line.cell_len for line in self._lines)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(self._lines)

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if y >= len(self._lines):
            return Strip.blank(width, self.rich_style)
        line = self._lines[y].copy()
        line.truncate(width, overflow="ellipsis")
        base = self.rich_style
        return Strip(Segment.apply_style(line.render(self.app.console), base))
