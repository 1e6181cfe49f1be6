"""The engine's state while it is paused or slowed: PAUSED, SLOW MOTION and its rate, for as long as they last."""

from textual.widgets import Static


def badge_text(paused: bool, delay: float) -> str:
    """What the badge says, with the keys that change it; "" when the engine runs at full speed (no badge)."""
    parts = ["PAUSED · f6 one step · f5 resumes"] if paused else []
    if delay:
        parts.append(f"SLOW MOTION {delay:g} s/step · f3 changes it")
    return " · ".join(parts)


class EngineBadge(Static):
    """A line across the whole screen, above the footer: it belongs to no tab and to no panel, and
    shows whatever the number of tabs, with the KV panel hidden or not. Over the tab row, where it
    was, it covered the last tabs. The app sets it when the state changes (f5, f3), never per tick:
    showing or hiding it lays the screen out once."""

    DEFAULT_CSS = """
    EngineBadge {
        width: 1fr;
        height: 1;
        padding: 0 1;
        background: $warning;
        color: $background;
        text-style: bold;
        display: none;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__("", **kwargs)
        self.text = ""

    def show_state(self, paused: bool, delay: float) -> None:
        text = badge_text(paused, delay)
        if text == self.text:
            return
        self.text = text
        if text:
            self.update(text)
        self.display = bool(text)
