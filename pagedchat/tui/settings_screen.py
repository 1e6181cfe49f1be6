"""A tab's system prompt and sampling settings."""

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, TextArea

from pagedchat.engine.params import SamplingParams


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
            with Horizontal():
                for name, label, value, hint in (
                        ("temperature", "Temperature", params.temperature, "0 is greedy"),
                        ("top_p", "Top-p", params.top_p, "in (0, 1]"),
                        ("max_tokens", "Max tokens", params.max_tokens, "per reply")):
                    with Vertical():
                        yield Label(label)
                        yield Input(str(value), id=name, tooltip=hint)
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
        try:
            params = SamplingParams(
                temperature=float(self.query_one("#temperature", Input).value),
                top_p=float(self.query_one("#top_p", Input).value),
                max_tokens=int(self.query_one("#max_tokens", Input).value),
                seed=self.settings.params.seed,
            )
        except ValueError as exc:
            self.query_one("#error", Static).update(str(exc))
            return
        system = self.query_one("#system", TextArea).text.strip() or None
        self.dismiss(TabSettings(system, params))

    def action_cancel(self) -> None:
        self.dismiss(None)
