"""The teaching-mode badge: PAUSED, SLOW MOTION and its rate, for as long as they last."""

from textual.widgets import Static


def badge_text(paused: bool, delay: float) -> str:
    """What the badge says; "" when the engine runs at full speed (no badge)."""
    parts = ["PAUSED · f6 steps"] if paused else []
    if delay:
        parts.append(f"SLOW MOTION {delay:g} s/step")
    return " · ".join(parts)


class EngineBadge(Static):
    """Top right of the chat area, over the tab row's free end, on a layer of its own: showing or
    hiding it moves nothing else. The app sets it when the state changes (f5, f3), never per tick."""

    DEFAULT_CSS = """
    EngineBadge {
        layer: badge;
        dock: right;
        width: auto;
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
