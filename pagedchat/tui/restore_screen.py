"""At start: offer back the tabs that were open when pagedchat last stopped."""

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label

from pagedchat.history import SavedChat


class RestoreScreen(ModalScreen[bool]):
    """Dismisses with True to restore the chats, False to start fresh."""

    BINDINGS = [Binding("escape", "fresh", "Start fresh")]

    DEFAULT_CSS = """
    RestoreScreen {
        align: center middle;
    }
    RestoreScreen > Vertical {
        width: 64;
        height: auto;
        border: round $primary;
        background: $surface;
        padding: 1 2;
    }
    RestoreScreen Label {
        width: 100%;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    RestoreScreen Horizontal {
        width: 100%;
        height: auto;
        align-horizontal: right;
        margin-top: 1;
    }
    """

    LISTED = 6

    def __init__(self, chats: list[SavedChat]) -> None:
        super().__init__()
        self.chats = chats

    def compose(self) -> ComposeResult:
        messages = sum(len(chat.messages) for chat in self.chats)
        with Vertical():
            yield Label(f"[b]{len(self.chats)} chat(s)[/b] from last time ({messages} messages):")
            for chat in self.chats[:self.LISTED]:
                yield Label(f"• {chat.title}", markup=False, classes="chat")
            if len(self.chats) > self.LISTED:
                yield Label(f"  … and {len(self.chats) - self.LISTED} more")
            with Horizontal():
                yield Button("Start fresh", id="fresh")
                yield Button("Restore", id="restore", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#restore").focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "restore")

    def action_fresh(self) -> None:
        self.dismiss(False)
