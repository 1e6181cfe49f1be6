"""A tab's system prompt and sampling settings."""

import math
from dataclasses import dataclass, replace

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, TextArea

from pagedchat.engine.api.params import SamplingParams


# The sampling fields, row by row: SamplingParams' name, the label, the tooltip.
FIELDS = (
    (("temperature", "Temperature", "0 is greedy"),
     ("top_p", "Top-p", "in (0, 1]"),
     ("max_tokens", "Max tokens", "per reply")),
    (("repetition_penalty", "Repetition penalty", "> 0; 1 is off; over the prompt and the reply"),
     ("presence_penalty", "Presence penalty", "in [-2, 2]; 0 is off; tokens the reply has used"),
     ("frequency_penalty", "Frequency penalty", "in [-2, 2]; 0 is off; by how often the reply used them")),
)


class Field(Input):
    """An Input whose alt+backspace deletes the word before the cursor, as everywhere else in the app
    (Textual's Input binds it to the word after; a terminal's ESC DEL reaches it as alt+backspace)."""

    BINDINGS = [Binding("alt+backspace", "delete_left_word", "Delete left to start of word", show=False)]


@dataclass(frozen=True)
class TabSettings:
    system_prompt: str | None
    params: SamplingParams


class SettingsScreen(ModalScreen[TabSettings | None]):
    """Edits a copy; dismisses with the new settings, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    DEFAULT_CSS = """
    SettingsScreen {
        align: center middle;
    }
    SettingsScreen > Vertical {
        width: 72;
        height: auto;
        border: round $primary;
        background: $surface;
        padding: 0 1;
    }
    SettingsScreen TextArea {
        height: 6;
    }
    SettingsScreen Horizontal {
        height: auto;
    }
    SettingsScreen Horizontal > Vertical {
        width: 1fr;
        height: auto;
    }
    SettingsScreen #error {
        color: $text-error;
        height: auto;
    }
    SettingsScreen #buttons {
        align-horizontal: right;
        margin-top: 1;
    }
    """

    def __init__(self, title: str, settings: TabSettings) -> None:
        super().__init__()
        self.title = title
        self.settings = settings

    def compose(self) -> ComposeResult:
        params = self.settings.params
        with Vertical():
            yield Label(f"[b]{self.title}[/b]: settings")
            yield Label("System prompt (empty: the model's default)")
            yield TextArea(self.settings.system_prompt or "", id="system", soft_wrap=True)
            for row in FIELDS:
                with Horizontal():
                    for name, label, hint in row:
                        with Vertical():
                            yield Label(label)
                            yield Field(_shown(getattr(params, name)), id=name, tooltip=hint)
            yield Static(id="error")
            with Horizontal(id="buttons"):
                yield Button("Cancel", id="cancel")
                yield Button("Save", id="save", variant="primary")

    def on_mount(self) -> None:
        # Typing goes to the first field at once: nothing is focused on a new screen otherwise.
        self.set_focus(self.query_one("#system", TextArea))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
            return
        values = {}
        for row in FIELDS:
            for name, _, _ in row:
                text = self.query_one(f"#{name}", Input).value.strip()
                try:
                    values[name] = int(text) if name == "max_tokens" else float(text)
                    if not math.isfinite(values[name]):
                        raise ValueError(text)
                except ValueError:
                    kind = "a whole number" if name == "max_tokens" else "a number"
                    self.query_one("#error", Static).update(f"{name} must be {kind}, got {text!r}")
                    return
        try:
            # The tab's other settings (its seed, stop strings, ...) are kept as they were.
            params = replace(self.settings.params, **values)
        except ValueError as exc:
            self.query_one("#error", Static).update(str(exc))
            return
        system = self.query_one("#system", TextArea).text.strip() or None
        self.dismiss(TabSettings(system, params))

    def action_cancel(self) -> None:
        self.dismiss(None)


def _shown(value: float | int | None) -> str:
    if value is None:
        return ""
    if isinstance(value, int):
        return str(value)
    short = f"{value:g}"  # 1.0 as "1", 0.95 as "0.95"; the full digits where that would round
    return short if float(short) == value else repr(value)
