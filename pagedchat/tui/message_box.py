"""The message box: several lines, pastes kept whole; enter sends, ctrl+j (or shift+enter) breaks a line."""

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea


# The message box's editing keys that the app's keys take, and what to press instead.
SHADOWED = (("ctrl+w", "delete the word before the cursor", "alt+backspace"),
            ("ctrl+e", "go to the end of the line", "end"),
            ("ctrl+y", "redo", "alt+y"),
            ("f6", "select the line", "alt+l"),
            ("f7", "select all", "alt+a"))


class MessageBox(TextArea):
    """A TextArea where `enter` sends the message instead of breaking the line.

    | Key | Description |
    | :- | :- |
    | enter | Send the message. |
    | ctrl+j, shift+enter | Insert a newline (most terminals send ctrl+j for shift+enter). |
    | alt+y | Redo (the app takes ctrl+y). |
    | alt+l | Select the line (the app takes f6). |
    | alt+a | Select all (the app takes f7). |

    The app's keys also take ctrl+w and ctrl+e, whose TextArea alternatives remain: alt+backspace
    deletes a word, end goes to the end of the line (`SHADOWED` lists them for f1).

    A terminal sends alt+a as ESC a, which Textual reads as the key alt+a with the character "a":
    TextArea would type the "a" before any binding ran, so the box's own keys run their action first.
    """

    BINDINGS = [
        Binding("ctrl+j,shift+enter", "newline", "Newline", key_display="ctrl+j"),
        Binding("alt+y", "redo", "Redo", show=False),
        Binding("alt+l", "select_line", "Select line", show=False),
        Binding("alt+a", "select_all", "Select all", show=False),
    ]
    _ACTIONS = {key: binding.action for binding in BINDINGS for key in binding.key.split(",")}

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
        if (action := self._ACTIONS.get(event.key)) is not None:
            event.stop()
            event.prevent_default()
            await self.run_action(action)
            return
        await super()._on_key(event)

    def action_newline(self) -> None:
        self.insert("\n")
