"""One message of a conversation, drawn as Markdown; a reply streams into it."""

from functools import cache

from markdown_it import MarkdownIt
from markdown_it.rules_core import StateCore
from textual.content import Content
from textual.widgets import Markdown

from pagedchat.tui.textual_private import MarkdownParagraph, SizedByLayout, keep_block_content, paragraphs_drawn_by

# A model can emit control characters (ESC, backspace, ...); written raw they would move the
# terminal's cursor and tear the screen. Show them as their Unicode control pictures instead.
_CONTROLS = {c: 0x2400 + c for c in range(0x20) if chr(c) not in "\n\t"} | {0x7F: 0x2421} | \
    {c: 0xFFFD for c in range(0x80, 0xA0)}


def visible(text: str) -> str:
    return text.translate(_CONTROLS)


def _keep_line_breaks(state: StateCore) -> None:
    """A line break the model wrote is one on screen, as in a GitHub comment (a poem's lines, a list
    of steps without bullets): Markdown joins a paragraph's lines into one, a "soft" break, and
    Textual draws that as a space. Code blocks keep their lines anyway; this is for paragraphs."""
    for token in state.tokens:
        for child in token.children or ():
            if child.type == "softbreak":
                child.type = "hardbreak"


@cache
def _parser() -> MarkdownIt:
    """One parser for every message: Markdown builds a new one for each update and each streamed
    piece otherwise (~0.6 ms apiece here, on the UI thread)."""
    parser = MarkdownIt("gfm-like")
    parser.core.ruler.push("keep_line_breaks", _keep_line_breaks)
    return parser


class StreamedParagraph(SizedByLayout, MarkdownParagraph):
    """A paragraph that asks for a layout only when its wrapped height changes. A streamed reply
    rewrites its last paragraph with every token, and a layout of the screen costs several times
    a repaint (then the anchored transcript's scrollbar takes another frame)."""

    def set_content(self, content: Content) -> None:
        # MarkdownBlock.set_content, with update(layout=False).
        keep_block_content(self, content)
        size = self.content_size
        self.update(content, layout=False)
        if not size.width or self.get_content_height(size, size, size.width) != size.height:
            self.refresh(layout=True)


@paragraphs_drawn_by(StreamedParagraph)
class ChatMessage(SizedByLayout, Markdown):
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
        super().__init__(visible(text), classes=f"-{role}", parser_factory=_parser)
        self.role = role
