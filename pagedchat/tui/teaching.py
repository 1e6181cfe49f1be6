"""Teaching mode: pause the engine, run it one step at a time (f5, f6), or slow it down (f3)."""

from textual.app import App

from pagedchat.tui.engine_badge import EngineBadge
from pagedchat.tui.kv_panel import KVPanel
from pagedchat.tui.source import Source, Teaching

SLOW_MOTION = (0.0, 0.25, 1.0)  # seconds between steps, cycled by f3


class TeachingMode:
    """The source's controls, where it has them; the badge, the panel's step marks and f5's footer
    entry follow them."""

    def __init__(self, app: App, source: Source) -> None:
        self._app = app
        self._source = source

    @property
    def paused(self) -> bool:
        return self._source.teaching is not None and self._source.teaching.paused

    @property
    def active(self) -> bool:
        """Paused or in slow motion: each step is worth drawing."""
        controls = self._source.teaching
        return controls is not None and (controls.paused or bool(controls.delay))

    def set_paused(self, paused: bool) -> None:
        if (controls := self._controls()) is None:
            return
        controls.set_paused(paused)
        self._app.notify("Engine paused: f6 runs one step, f5 resumes." if paused else "Engine resumed.")
        self._show(controls)

    def step(self) -> None:
        if (controls := self._controls()) is None:
            return
        if not controls.paused:
            self._app.notify("f6 runs one step while the engine is paused (f5).", severity="warning")
            return
        controls.step_once()

    def slow_motion(self) -> None:
        if (controls := self._controls()) is None:
            return
        delay = SLOW_MOTION[(SLOW_MOTION.index(controls.delay) + 1) % len(SLOW_MOTION)] \
            if controls.delay in SLOW_MOTION else 0.0
        controls.set_delay(delay)
        self._app.notify(f"Slow motion: {delay:g} s between steps." if delay else "Slow motion off.")
        self._show(controls)

    def _controls(self) -> Teaching | None:
        if self._source.teaching is None:
            self._app.notify("Pause, step and slow motion work on the local engine only: "
                             "an attached server's engine runs on its own.", severity="warning")
        return self._source.teaching

    def _show(self, controls: Teaching) -> None:
        """Only when the state changes: the badge lays the screen out, the footer recomposes."""
        self._app.query_one(EngineBadge).show_state(controls.paused, controls.delay)
        self._app.query_one(KVPanel).set_step_marks(controls.paused or bool(controls.delay))
        self._app.refresh_bindings()
