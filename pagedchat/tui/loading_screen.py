"""Shown while the model loads in a worker thread, so the terminal never looks frozen."""

import time

from textual.app import ComposeResult
from textual.containers import Center, Middle
from textual.screen import Screen
from textual.widgets import ProgressBar, Static


class LoadingScreen(Screen):
    DEFAULT_CSS = """
    LoadingScreen {
        align: center middle;
    }
    LoadingScreen Static {
        width: auto;
        margin: 1 0;
    }
    LoadingScreen #title {
        text-style: bold;
        color: $primary;
    }
    """

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self._started = time.monotonic()

    def compose(self) -> ComposeResult:
        with Middle():
            with Center():
                yield Static("pagedchat", id="title")
            with Center():
                yield Static(f"loading {self.what}", id="what")
            with Center():
                yield ProgressBar(total=None, show_eta=False)  # no total: loading reports no fractions
            with Center():
                yield Static("0 s", id="elapsed")

    def on_mount(self) -> None:
        self.set_interval(0.5, self._tick)

    def _tick(self) -> None:
        self.query_one("#elapsed", Static).update(f"{time.monotonic() - self._started:.0f} s")
