"""The pool's event log: allocate, free, evict, share, cow, preempt, release, with the session."""

from collections.abc import Callable
from itertools import groupby

from rich.text import Text
from textual.widgets import RichLog

from pagedchat.engine.api.snapshot import BlockEvent, KVSnapshot
from pagedchat.tui.textual_private import ScrollsWithoutLayout
from pagedchat.tui.themes import SessionTag

MAX_IDS = 8  # block ids listed per line at most; a long prefill allocates dozens in one step


class EventLog(ScrollsWithoutLayout, RichLog):
    """New events of each snapshot, one line per run of same-kind events of one request in one step."""

    DEFAULT_CSS = """
    EventLog {
        height: 1fr;
        min-height: 2;
        border-top: hkey $panel;
        padding: 0 1;
        scrollbar-size-vertical: 1;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(max_lines=400, wrap=False, markup=False, **kwargs)
        self._last_seq = -1

    def show(self, snapshot: KVSnapshot, tag_of: Callable[[str], SessionTag]) -> None:
        fresh = [event for event in snapshot.events if event.seq > self._last_seq]
        if not fresh:
            return
        self._last_seq = fresh[-1].seq
        colours = self.app.theme_variables
        width = self.scrollable_content_region.width or None
        for (step, kind, request_id), run in groupby(fresh, lambda e: (e.step, e.kind, e.request_id)):
            self.write(self._line(step, kind, request_id, list(run), tag_of, colours, width), scroll_end=False)
        # At once, not after the next frame as `write` would: that frame would be followed by another.
        self.scroll_end(animate=False, immediate=True, x_axis=False)

    @staticmethod
    def _line(step: int, kind: str, request_id: str | None, run: list[BlockEvent],
              tag_of: Callable[[str], SessionTag], colours: dict[str, str], width: int | None) -> Text:
        """The ids that fit in `width` (a line wider than the log would take a row for a scrollbar),
        MAX_IDS at most, and how many more there are."""
        text = Text(f"{step:>5} ", style="dim")
        text.append(f"{kind:<8}", style="bold")
        if request_id is not None:
            tag = tag_of(request_id)
            text.append(f" {tag.name}", style=colours[tag.variable])
        ids = [f" #{e.block_id}" for e in run if e.block_id is not None]

        def listed(shown: int) -> str:
            return "".join(ids[:shown]) + (f" +{len(ids) - shown}" if shown < len(ids) else "")

        shown = min(len(ids), MAX_IDS)
        while shown and width is not None and text.cell_len + len(listed(shown)) > width:
            shown -= 1
        text.append(listed(shown))
        return text
