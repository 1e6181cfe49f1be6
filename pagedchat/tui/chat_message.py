"""One message of a conversation, drawn as Markdown; a reply streams into it."""

from textual.widgets import Markdown


class ChatMessage(Markdown):
    DEFAULT_CSS = """
    ChatMessage {
        margin: 0 0 1 0;
        padding: 0 1;
        border-left: outer $panel;
        background: $surface;
    }
    ChatMessage.-user {
        border-left: outer $secondary;
        background: $boost;
    }
    ChatMessage.-assistant {
        border-left: outer $primary;
    }
    ChatMessage.-error {
        border-left: outer $error;
        color: $text-error;
    }
    ChatMessage.-notice {
        border-left: outer $warning;
        color: $text-warning;
    }
    """

    def __init__(self, role: str, text: str = "") -> None:
        super().__init__(text, classes=f"-{role}")
        self.role = role
