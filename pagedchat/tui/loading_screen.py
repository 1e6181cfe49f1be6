"""Shown while the model loads in a worker thread, so the terminal never looks frozen.

It has a message box of its own: what the user types while waiting is not lost. A message sent
there goes to the first chat tab once the model is ready; a draft moves into that tab's box.
"""

import time

from textual.app import ComposeResult
from textual.containers import Center, Middle
from textual.screen import Screen
from textual.widgets import ProgressBar, Static

from pagedchat.tui.message_box import MessageBox

HINT = "You can type your first message now: it is sent once the model is ready."
QUEUED = "Your message is sent once the model is ready."


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
    LoadingScreen #hint {
        color: $text-muted;
    }
    LoadingScreen MessageBox {
        width: 80%;
    }
    """

    def __init__(self, what: str, doing: str = "loading") -> None:
        super().__init__()
        self.what = what
        self.doing = doing
        self.sent = False  # the user pressed enter: the box holds a message to send, not a draft
        self._started = time.monotonic()

    def compose(self) -> ComposeResult:
        with Middle():
            with Center():
                yield Static("pagedchat", id="title")
            with Center():
                yield Static(f"{self.doing} {self.what}", id="what")
            with Center():
                yield ProgressBar(total=None, show_eta=False)  # no total: loading reports no fractions
            with Center():
                yield Static("0 s", id="elapsed")
            with Center():
                yield Static(HINT, id="hint")
            with Center():
                yield MessageBox()

    def on_mount(self) -> None:
        self.set_interval(0.5, self._tick)

    def _tick(self) -> None:
        self.query_one("#elapsed", Static).update(f"{time.monotonic() - self._started:.0f} s")

    @property
    def typed(self) -> str:
        return self.query_one(MessageBox).text

    def on_message_box_submitted(self, event: MessageBox.Submitted) -> None:
        event.stop()
        if event.text.strip():
            self.sent = True
            event.box.read_only = True
            self.query_one("#hint", Static).update(QUEUED)
