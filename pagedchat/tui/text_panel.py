"""A widget that shows a rich Text and updates cheaply.

`Static.update` asks for a layout of the whole screen on every change; while replies stream, that
was most of the UI's cost. A repaint is enough unless the number of lines changed.
"""

from rich.text import Text
from textual.widget import Widget


class TextPanel(Widget):
    def __init__(self, text: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self._text = Text(text)

    def render(self) -> Text:
        return self._text

    def set_text(self, text: Text) -> None:
        if text == self._text:
            return
        relayout = text.plain.count("\n") != self._text.plain.count("\n")
        self._text = text
        self.refresh(layout=relayout)
