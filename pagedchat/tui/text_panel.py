"""A widget that shows lines of rich Text and updates cheaply.

`Static.update` re-renders every line and asks for a layout of the whole screen on each change;
while replies stream, that was most of the UI's cost. This one draws with the line API: a new text
repaints only the lines that differ (Textual caches the rest), and lays out only when the number of
lines changed. A line does not wrap: one too long for the widget ends in an ellipsis.
"""

from rich.segment import Segment
from rich.text import Text
from textual.geometry import Region, Size
from textual.strip import Strip
from textual.widget import Widget

from pagedchat.tui.textual_private import SizedByLayout


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
