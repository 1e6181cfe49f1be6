"""The footer, with the keys that lead to everything else first."""

from textual.app import ComposeResult
from textual.widgets import Footer

# Help (every key), the tab's settings, the KV panel and the engine's pause: on an 80-column screen
# the footer has room for a handful of keys, and these must be among them.
FIRST = ("f1", "f2", "f4", "f5")


class KeyFooter(Footer):
    """Footer lists the focused widget's keys first, so the message box's own f6 and ctrl+w (which
    the app's keys take over) led, and at 80 columns f1, f2, f4 and f5 fell off the end. This one
    puts FIRST first, then the app's keys in the order of its bindings, then the message box's own.
    Footer's keys (FooterKey, not exported by Textual) carry their `key`."""

    def compose(self) -> ComposeResult:
        order = [*FIRST, *(key for binding in self.app.BINDINGS for key in binding.key.split(","))]

        def rank(widget) -> int:
            key = getattr(widget, "key", None)
            return order.index(key) if key in order else len(order)

        yield from sorted(super().compose(), key=rank)  # sorted is stable: the message box's keep their order
