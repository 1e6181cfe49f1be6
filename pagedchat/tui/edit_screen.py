"""ctrl+o: pick one of the tab's messages to edit and resend, in a new tab."""

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

SHOWN_CHARS = 66  # of a message, on its one line in the list


def shortened(text: str, width: int = SHOWN_CHARS) -> str:
    """The message on one line, cut with an ellipsis if it is longer than `width`."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[:width - 1] + "…"


class EditScreen(ModalScreen[int | None]):
    """Lists a tab's messages (`(turn index, text)`, in order); dismisses with the chosen one's turn
    index, or None when cancelled.

    | Key | Description |
    | :- | :- |
    | up, down | Move between the messages (the last one is highlighted first). |
    | enter | Edit the highlighted message in a new tab. |
    | escape | Cancel. |
    """

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    DEFAULT_CSS = """
    EditScreen {
        align: center middle;
    }
    EditScreen > Vertical {
        width: 76;
        height: auto;
        border: round $primary;
        background: $surface;
        padding: 0 1;
    }
    EditScreen Label {
        width: 1fr;
        margin-bottom: 1;
    }
    EditScreen OptionList, EditScreen OptionList:focus {
        height: auto;
        max-height: 16;
        border: none;
        padding: 0;
        background: $surface;
    }
    EditScreen #keys {
        color: $text-muted;
        margin: 1 0 0 0;
    }
    """

    def __init__(self, title: str, messages: list[tuple[int, str]]) -> None:
        super().__init__()
        self.chat_title = title
        self.messages = messages

    def compose(self) -> ComposeResult:
        with Vertical():
            # Not markup: a title restored from the history may hold brackets.
            yield Label(f"Edit and resend a message of {self.chat_title}: a new tab holds the chat "
                        "before it, and the message in its box to edit.", markup=False)
            yield OptionList(*(Option(shortened(text), id=str(index)) for index, text in self.messages))
            yield Label("enter edits it · escape cancels", id="keys")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        options.highlighted = len(self.messages) - 1  # the last message is the likeliest to rework
        options.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(int(event.option.id))

    def action_cancel(self) -> None:
        self.dismiss(None)
