"""The message box: several lines, pastes kept whole; enter sends, ctrl+j (or shift+enter) breaks a line."""

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea


class MessageBox(TextArea):
    """A TextArea where `enter` sends the message instead of breaking the line.

    | Key | Description |
    | :- | :- |
    | enter | Send the message. |
    | ctrl+j, shift+enter | Insert a newline (most terminals send ctrl+j for shift+enter). |
    """

    BINDINGS = [Binding("ctrl+j,shift+enter", "newline", "Newline", key_display="ctrl+j")]

    DEFAULT_CSS = """
    MessageBox {
        height: auto;
        min-height: 3;
        max-height: 12;
        border: round $panel;
        padding: 0 1;
    }
    MessageBox:focus {
        border: round $primary;
    }
    """

    class Submitted(Message):
        def __init__(self, box: "MessageBox", text: str) -> None:
            super().__init__()
            self.box = box
            self.text = text

        @property
        def control(self) -> "MessageBox":
            return self.box

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, compact=True, **kwargs)
        # A steady cursor: blinking draws a frame twice a second, taken from the engine while
        # replies stream, and wakes an idle app.
        self.cursor_blink = False
        self.placeholder = "Message (enter sends, ctrl+j new line)"

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
            return
        await super()._on_key(event)

    def action_newline(self) -> None:
        self.insert("\n")
