"""The chat tabs' labels: each tab's colour, title, token count and state, relabelled only when they change."""

import time
from collections.abc import Callable, Mapping

from rich.text import Text
from textual.content import Content
from textual.widgets import TabbedContent

from pagedchat.engine.api.snapshot import KVSnapshot
from pagedchat.tui.chat_pane import ChatPane
from pagedchat.tui.themes import SessionTag

LABEL_COUNT_EVERY_S = 0.5  # a streaming tab's count relabels at most this often: at most a second old
STATES = {"waiting": "waiting", "running": "generating", "preempted": "preempted"}
STATE_WIDTH = max(map(len, STATES.values()))
# A compact tab label's mark, in its session's colour, where a full one has "■": 4 compact tabs fit in 40 columns.
STATE_MARKS = {"idle": "■", "waiting": "⋯", "generating": "▸", "preempted": "‖"}


class TabLabels:
    """`num_tokens(pane)`: the tab's conversation in tokens where no snapshot has its request (the
    source's count: a server applies the chat template itself)."""

    def __init__(self, tabbed: Callable[[], TabbedContent], colours: Callable[[], Mapping[str, str]],
                 num_tokens: Callable[[ChatPane], int]) -> None:
        self.max_len: int | None = None
        self._tabbed = tabbed
        self._colours = colours  # the theme's variables
        self._num_tokens = num_tokens
        self._shown: dict[str, tuple] = {}  # tab id: (title, theme, state, compact), token count as shown
        self._counts_shown_at = 0.0

    def label(self, title: str, colour: int, tokens: int, state: str = "idle", compact: bool = False) -> Content:
        """The tab's colour, title, tokens and state; compact, the state's mark in the colour, and the title."""
        mark = STATE_MARKS[state] if compact else "■"
        label = Text(f"{mark} ", style=self._colours()[SessionTag(title, colour).variable])
        if compact:
            label.append(title)
            return Content.from_rich_text(label)
        label.append(f"{title} ")
        # Fixed-width fields: a tab that changes width shifts the tabs after it, and the active
        # tab's underline then slides there over some twenty frames.
        label.append(f"{tokens:>{len(str(self.max_len))}} tok · {state:<{STATE_WIDTH}}", style="dim")
        return Content.from_rich_text(label)

    def shown(self, key: str) -> str:
        """A tab's label as on screen, as plain text."""
        return self._tabbed().get_tab(key).label.plain

    def forget(self, key: str) -> None:
        self._shown.pop(key, None)

    def update(self, panes: Mapping[str, ChatPane], snapshot, theme: str) -> None:
        infos = {info.request_id: info for info in snapshot.requests} if isinstance(snapshot, KVSnapshot) else {}
        compact = self._overflow(panes)
        labels = {}
        for key, pane in panes.items():
            info = infos.get(pane.conversation.request_id)
            # Without the request in a snapshot (not stepped yet, or a server that publishes none), the
            # reply's own progress tells waiting from generating.
            progress = pane.chat.progress(pane.conversation.request_id) if pane.replying else None
            status = info.status if info else "running" if progress and progress.token_ids else "waiting"
            state = STATES.get(status, "idle") if pane.replying else "idle"
            tokens = info.num_tokens if info else self._num_tokens(pane)
            labels[key] = ((pane.title, theme, state, compact), 0 if compact else tokens)
        changed = {key: label for key, label in labels.items() if self._shown.get(key) != label}
        # A relabel lays out the whole screen (~15 ms here), however many tabs it changes. While
        # replies stream, counts alone relabel every LABEL_COUNT_EVERY_S at most (the block tables
        # show them live), and all changed tabs go together; at rest a count is exact.
        now = time.monotonic()
        streaming_counts_only = all(key in self._shown and self._shown[key][0] == look and look[2] != "idle"
                                    for key, (look, _) in changed.items())
        if not changed or (streaming_counts_only and now - self._counts_shown_at < LABEL_COUNT_EVERY_S):
            return
        self._counts_shown_at = now
        self._shown |= changed
        for key, ((_, _, state, compact), tokens) in changed.items():
            pane = panes[key]
            self._tabbed().get_tab(key).label = self.label(pane.title, pane.colour, tokens, state, compact)

    def _overflow(self, panes: Mapping[str, ChatPane]) -> bool:
        """Whether the tabs' full labels would not all fit in the tab bar: then they are compact."""
        width = self._tabbed().size.width
        full = len(str(self.max_len)) + STATE_WIDTH + 12  # "■ ", " ", " tok · " and the tab's padding
        return width > 0 and sum(len(pane.title) + full for pane in panes.values()) > width
