"""What pagedchat.tui.textual_private relies on is still in Textual: an upgrade that moves one fails
here, by name."""

import inspect

from textual._xterm_parser import XTermParser
from textual.content import Content
from textual.reactive import Reactive
from textual.widget import Widget
from textual.widgets import Markdown, Tabs
from textual.widgets.markdown import MarkdownBlock

from pagedchat.tui import textual_private


def test_tabs_can_still_place_their_underline_at_once():
    assert "animate" in inspect.signature(Tabs._highlight_active).parameters


def test_widgets_still_set_their_virtual_size_after_each_layout():
    """SizedByLayout and ScrollsWithoutLayout intercept that assignment by redeclaring the reactive."""
    assert "self.virtual_size = virtual_size" in inspect.getsource(Widget._size_updated)
    assert isinstance(Widget.__dict__["virtual_size"], Reactive)


def test_a_widget_can_still_update_its_scrollbars_alone():
    assert list(inspect.signature(Widget._scroll_update).parameters) == ["self", "virtual_size"]


def test_markdown_still_has_a_block_table_with_a_paragraph():
    assert issubclass(textual_private.MarkdownParagraph, MarkdownBlock)
    @textual_private.paragraphs_drawn_by(MarkdownBlock)
    class Drawn(Markdown):
        pass

    assert Drawn.BLOCKS["paragraph_open"] is MarkdownBlock and set(Drawn.BLOCKS) == set(Markdown.BLOCKS)
    assert Markdown.BLOCKS["paragraph_open"] is textual_private.MarkdownParagraph  # Markdown's own, untouched


def test_markdown_blocks_still_keep_their_content_where_paragraphs_copy_it():
    assert "self._content = content" in inspect.getsource(MarkdownBlock.set_content)
    assert "block._content" in inspect.getsource(textual_private.MarkdownParagraph)
    block = object.__new__(textual_private.MarkdownParagraph)
    textual_private.keep_block_content(block, Content("text"))
    assert block._content == Content("text")


def test_the_terminal_parser_reads_esc_del_as_alt_backspace_and_ctrl_w_as_itself():
    textual_private.read_alt_backspace_as_itself()
    keys = [event.key for data in (textual_private.ESC_DEL, "\x17") for event in XTermParser().feed(data)]
    assert keys == ["alt+backspace", "ctrl+w"]
