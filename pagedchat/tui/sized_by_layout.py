"""A mixin for widgets that do not scroll."""

from textual.geometry import Size
from textual.reactive import Reactive


class SizedByLayout:
    """A widget that does not scroll: its virtual size is its size, set by the layout that just
    placed it, which also repaints it. Widget's `virtual_size` asks for another layout of the whole
    screen and another repaint when it changes, so each widget that grew cost two layouts (~25 ms
    and ~10 ms here) and then a frame of its own.

    Textual has no public switch for this: redeclaring the reactive relies on Widget setting
    `self.virtual_size` after each layout (Widget._size_updated), which this declaration intercepts."""

    virtual_size: Reactive[Size] = Reactive(Size(0, 0), layout=False, repaint=False)
