"""Every private part of Textual that pagedchat relies on, in one place.

Each is here because Textual offers no public way to do what it does, and each says why. A Textual
upgrade that moves one fails `tests/test_tui_textual_private.py` by name, rather than quietly drawing
a wrong screen or costing frames again.
"""

from collections.abc import Callable
from types import SimpleNamespace

from textual._ansi_sequences import ANSI_SEQUENCES_KEYS
from textual.content import Content
from textual.geometry import Size
from textual.reactive import Reactive
from textual.widgets import Markdown, Tabs


def place_tab_underline(tabs: Tabs) -> None:
    """Place the active tab's underline again, now. Tabs place it only on a resize or a change of tab,
    and a tab added before the screen's first layout keeps an underline of zero width otherwise."""
    tabs._highlight_active(False)


class SizedByLayout:
    """A widget that does not scroll: its virtual size is its size, set by the layout that just
    placed it, which also repaints it. Widget's `virtual_size` asks for another layout of the whole
    screen and another repaint when it changes, so each widget that grew cost two layouts (~25 ms
    and ~10 ms here) and then a frame of its own.

    Redeclaring the reactive relies on Widget setting `self.virtual_size` after each layout
    (`Widget._size_updated`), which this declaration intercepts."""

    virtual_size: Reactive[Size] = Reactive(Size(0, 0), layout=False, repaint=False)


class ScrollsWithoutLayout:
    """A widget of fixed size (1fr) whose content grows, like a log: a new line updates its scrollbars
    only. Widget's `virtual_size` asks for a layout of the whole screen (~15 ms here) instead.
    `_scroll_update` is how Textual's own OptionList does it, after setting its virtual size."""

    virtual_size: Reactive[Size] = Reactive(Size(0, 0), layout=False)

    def watch_virtual_size(self, size: Size) -> None:
        self._scroll_update(size)


# Textual's MarkdownParagraph: textual.widgets.markdown does not export the class, only the block table.
MarkdownParagraph = Markdown.BLOCKS["paragraph_open"]


def paragraphs_drawn_by(paragraph: type) -> Callable[[type[Markdown]], type[Markdown]]:
    """A class decorator: the Markdown subclass draws its paragraphs with `paragraph` (its block table,
    `BLOCKS`, has no public setter)."""
    def decorate(markdown: type[Markdown]) -> type[Markdown]:
        markdown.BLOCKS = {**Markdown.BLOCKS, "paragraph_open": paragraph}
        return markdown

    return decorate


def keep_block_content(block, content: Content) -> None:
    """What `MarkdownBlock.set_content` records besides updating: MarkdownParagraph copies it from the
    new block to the shown one when a streamed reply updates."""
    block._content = content


# What a terminal sends for alt+backspace (xterm, tmux, VTE, ... without the kitty keyboard protocol).
ESC_DEL = "\x1b\x7f"


def read_alt_backspace_as_itself() -> None:
    """Textual reads ESC DEL as ctrl+w (readline's meaning of both: delete a word), so alt+backspace
    would close the tab, which ctrl+w does in this app. Read as alt+backspace, it reaches TextArea's own
    binding for that key, which deletes the word; a real ctrl+w (^W) is unchanged. The parser's table has
    no public setter; it reads an entry as a tuple of keys and takes each one's `value` (Textual's `Keys`
    enum has no alt+backspace to put there)."""
    ANSI_SEQUENCES_KEYS[ESC_DEL] = (SimpleNamespace(value="alt+backspace"),)
