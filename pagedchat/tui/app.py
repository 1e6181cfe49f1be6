"""The app: chat tabs on the left, the KV panel on the right, one source of replies and snapshots behind
them (`pagedchat.tui.source`). It keeps the tabs and routes each action to the tab on show."""

import asyncio
import gc
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.containers import Container, Horizontal
from textual.screen import Screen
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import TabbedContent, Tabs

from pagedchat.engine.api.errors import one_line
from pagedchat.engine.api.params import SamplingParams
from pagedchat.engine.runtime.engine_thread import EngineThread
from pagedchat.history import History, SavedChat
from pagedchat.tui.chat_backend import ChatBackend
from pagedchat.tui.chat_pane import ChatPane, export_folder
from pagedchat.tui.conversation import DEFAULT_PARAMS
from pagedchat.tui.demo_driver import DemoDriver
from pagedchat.tui.engine_badge import EngineBadge
from pagedchat.tui.footer import KeyFooter
from pagedchat.tui.frame_budget import MAX_DRAW_GAP_S, POLL_HZ, UI_CPU_SHARE, FrameBudget
from pagedchat.tui.help_screen import HelpScreen
from pagedchat.tui.keys import BINDINGS, CHAT_ACTIONS
from pagedchat.tui.kv_panel import KVPanel
from pagedchat.tui.loading_screen import LoadingScreen
from pagedchat.tui.restore_screen import RestoreScreen
from pagedchat.tui.source import LocalEngine, Source
from pagedchat.tui.tab_labels import TabLabels
from pagedchat.tui.tabs import ChatTabs
from pagedchat.tui.teaching import TeachingMode
from pagedchat.tui.textual_private import place_tab_underline, read_alt_backspace_as_itself
from pagedchat.tui.themes import DEFAULT_THEME, load_themes

if TYPE_CHECKING:
    from pagedchat.tui.attached import Attached, AttachTarget

log = logging.getLogger(__name__)

PANEL_EVERY_S = 0.4  # the KV panel's redraws while the engine runs (teaching mode: every step)


class PagedChatApp(App):
    """`load_llm` builds the `LLM` (in a worker thread, after the screen opens); with `attach` the tabs
    chat with that server instead, and no model is loaded.

    Read by tests and benchmarks: `source`, `worker`, `attached`, `chat`, `panes`, `current_pane`,
    `demo`, `tab_labels`."""

    CSS_PATH = "app.tcss"
    TITLE = "pagedchat"
    AUTO_FOCUS = "MessageBox"

    BINDINGS = BINDINGS
    # The screen's class by its height: app.tcss fits the KV panel into a short one (24 rows).
    VERTICAL_BREAKPOINTS = [(0, "-short"), (32, "-tall")]

    def __init__(self, load_llm: Callable[[], object] | None, *, model_name: str = "the model",
                 attach: "AttachTarget | None" = None,
                 theme: str = DEFAULT_THEME, demo: str | None = None, params: SamplingParams = DEFAULT_PARAMS,
                 history: History | None = None,
                 on_engine: Callable[[object, EngineThread], None] | None = None) -> None:
        """`on_engine(llm, worker)`: told once the engine thread runs (`serve --tui` serves it too)."""
        super().__init__()
        read_alt_backspace_as_itself()  # an editing key, which must not close the tab as ctrl+w does
        self.history = history  # None: nothing is saved (--no-history)
        for theme_obj in load_themes().values():
            self.register_theme(theme_obj)
        self.theme = theme
        self.load_error: str | None = None  # why loading failed, for the one line the CLI prints
        self.source: Source
        if attach is not None:  # the attach extra's packages are imported only when attaching
            from pagedchat.tui.attached import Attached

            self.source = Attached(attach, on_text=self.redraw_panel)
        else:
            self.source = LocalEngine(load_llm, model_name, self._wake, on_engine, notify=self.notify)
        self.teaching = TeachingMode(self, self.source)
        self.demo = DemoDriver(self, demo)
        self.tabs = ChatTabs(self, params)
        self.tab_labels = TabLabels(lambda: self.tabs.tabbed, lambda: self.theme_variables,
                                    lambda pane: self.source.num_tokens(pane.conversation))
        self._snapshot = None  # the one the panel shows
        self._panel_drawn_at = -math.inf
        self._poll_timer: Timer | None = None
        self._quiet_polls = 0
        self._frame_budget = FrameBudget(UI_CPU_SHARE, MAX_DRAW_GAP_S)

    @property
    def worker(self) -> EngineThread | None:
        return self.source.worker

    @property
    def attached(self) -> "Attached | None":
        return self.source.attached

    @property
    def chat(self) -> ChatBackend | None:
        return self.source.chat

    @property
    def panes(self) -> Mapping[str, ChatPane]:
        """The open tabs' panes, by key, in the order opened."""
        return MappingProxyType(self.tabs.panes)

    @property
    def current_pane(self) -> ChatPane | None:
        return self.tabs.current

    @property
    def _panel(self) -> Widget:
        return self.query_one("#panel")

    def get_theme_variable_defaults(self) -> dict[str, str]:
        # Textual's own themes lack the session and block colours: borrow the default theme's.
        return dict(load_themes()[DEFAULT_THEME].variables)

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            with Container(id="chat-area"):
                yield TabbedContent(id="chats")
            yield KVPanel(id="panel")
        yield EngineBadge()
        yield KeyFooter()

    def on_mount(self) -> None:
        self._ui_loop, self._ui_thread = asyncio.get_running_loop(), threading.get_ident()
        # kill -TERM, or the terminal closing (HUP): quit the normal way, so the terminal is restored.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._ui_loop.add_signal_handler(sig, self.exit)
        self.push_screen(LoadingScreen(*self.source.loading))
        self._open_source()

    async def on_unmount(self) -> None:
        await self.source.close()
        gc.unfreeze()  # a process that goes on (tests, benchmarks) can collect what the app held

    # -- opening -----------------------------------------------------------------------------------

    @work(exit_on_error=False)
    async def _open_source(self) -> None:
        try:
            await self.source.open()
        except Exception as exc:
            log.exception("%s %s failed", self.source.loading[1], self.source.loading[0])
            self.load_error = one_line(exc)
            self.exit(return_code=1)
            return
        self.tab_labels.max_len = self.source.chat.max_len
        if (panel := self.source.panel()) is not None:
            await self._panel.remove()
            await self.query_one("#main").mount(panel)
        self._poll_timer = self.set_interval(1 / POLL_HZ, self._poll)
        saved = self.history.open_chats() if self.history and not self.demo.on else []
        if saved:
            typed = await self._close_loading()
            self.push_screen(RestoreScreen(saved), lambda restore: self._restore(saved, restore, typed))
            return
        # The first tabs open under the loading screen, whose message box takes the keys meanwhile.
        if self.demo.on:
            await self.demo.start()
        else:
            await self.action_new_chat()
        self.tabs.carry_over(*await self._close_loading())

    async def _close_loading(self) -> tuple[str, bool]:
        """Pop the loading screen (the main screen has focus back once this returns): what the user
        typed there, and whether they sent it."""
        loading = self.screen
        assert isinstance(loading, LoadingScreen)
        typed = loading.typed, loading.sent
        await self.pop_screen()
        # A tab added under the loading screen may have been measured before the main screen's first layout.
        if self.tabs.tabbed.tab_count:
            self.call_after_refresh(place_tab_underline, self.tabs.tabbed.query_one(Tabs))
        return typed

    async def _restore(self, saved: list[SavedChat], restore: bool, typed: tuple[str, bool]) -> None:
        await self.tabs.restore(saved, restore)
        self.tabs.carry_over(*typed)

    # -- tabs --------------------------------------------------------------------------------------

    async def action_new_chat(self) -> None:
        await self.tabs.new()

    async def action_close_chat(self) -> None:
        if (pane := self.current_pane) is not None:
            await self.tabs.close(pane)

    async def action_reopen_chat(self) -> None:
        await self.tabs.reopen()

    async def action_fork_chat(self) -> None:
        if (pane := self.current_pane) is not None:
            await self.tabs.fork(pane)

    def action_edit_message(self) -> None:
        self._on_pane(self.tabs.edit)

    def action_previous_tab(self) -> None:
        self.tabs.tabbed.query_one(Tabs).action_previous_tab()

    def action_next_tab(self) -> None:
        self.tabs.tabbed.query_one(Tabs).action_next_tab()

    async def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        # A stale activation (the tab changed again since) must not pull focus back to its pane:
        # focusing a pane activates its tab, and two such messages in flight would ping-pong. One
        # that arrives while the app closes finds the widgets gone (is_attached is False then).
        pane = event.pane
        if isinstance(pane, ChatPane) and pane.is_attached and pane.id == event.tabbed_content.active:
            self.tabs.focus_box(pane)
            await pane.draw()  # its reply as it is now, in the frame that shows the tab, not a draw later

    # -- actions on the tab on show, the panel and the engine ----------------------------------------

    def _on_pane(self, act: Callable[[ChatPane], object]) -> None:
        if (pane := self.current_pane) is not None:
            act(pane)

    def action_stop(self) -> None:
        self._on_pane(ChatPane.stop)

    def action_regenerate(self) -> None:
        self._on_pane(ChatPane.regenerate)

    def action_copy_reply(self) -> None:
        self._on_pane(ChatPane.copy_reply)

    def action_export_chat(self) -> None:
        self._on_pane(ChatPane.export)

    def action_settings(self) -> None:
        self._on_pane(ChatPane.edit_settings)

    def action_toggle_panel(self) -> None:
        """Hide the KV panel (the chat takes the whole width) or show it again."""
        panel = self._panel
        panel.display = not panel.display
        self.notify("KV panel shown." if panel.display else "KV panel hidden: f4 shows it again.")

    def action_toggle_contiguous(self) -> None:
        for panel in self.query(KVPanel):  # none when attached to a server that sends no grid
            self.notify("Contiguous view shown: a model." if panel.toggle_contiguous() else "Contiguous view hidden.")

    def deliver_screenshot(self, filename: str | None = None, path: str | None = None,
                           time_format: str | None = None) -> str | None:
        """The palette's Screenshot: into the export folder, made if missing, not Textual's default
        folder, the downloads, which may not exist (then the save failed without saying why)."""
        folder = Path(path) if path else export_folder()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self.notify(f"Could not save the screenshot in {folder}: {one_line(exc)}", severity="error")
            return None
        return super().deliver_screenshot(filename, str(folder), time_format)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_pause(self) -> None:
        self.teaching.set_paused(True)

    def action_resume(self) -> None:
        self.teaching.set_paused(False)

    def action_step(self) -> None:
        self.teaching.step()

    def action_slow_motion(self) -> None:
        self.teaching.slow_motion()

    async def action_toggle_demo(self) -> None:
        await self.demo.toggle()

    # -- the picture -------------------------------------------------------------------------------

    async def _poll(self) -> None:
        """The UI's tick: the panel, the tab labels and the reply on show change together, in one
        frame, as often as the frame budget allows while the engine runs (each frame costs the
        engine a slice of a core and of the GIL)."""
        if not self.is_running:  # shutting down: the widgets are going away
            return
        for pane in self.tabs.panes.values():
            pane.catch_up()  # every tab keeps its reply in progress (and its saved copy) current
        # The budget guards a running engine; in teaching mode each step is drawn at once.
        teaching = self.teaching.active
        if not self._frame_budget.due() and not teaching:
            return
        with self.batch_update():  # one frame for all of it
            if (pane := self.current_pane) is not None:
                await pane.draw()
            snapshot = self.source.snapshot
            if snapshot is not self._snapshot:
                self._quiet_polls = 0
                # Repainting the panel is most of a frame's cost: while replies stream, it follows
                # at PANEL_EVERY_S, the reply on show at every draw.
                now = time.monotonic()
                if teaching or now - self._panel_drawn_at >= PANEL_EVERY_S:
                    self._snapshot, self._panel_drawn_at = snapshot, now
                    self.redraw_panel()
            elif not self.source.moves_on_its_own and not any(p.replying for p in self.tabs.panes.values()):
                # The engine moves only on a command (`_wake`): after a quiet second, stop polling
                # until the next command, so an idle app costs nothing.
                self._quiet_polls += 1
                if self._quiet_polls > POLL_HZ:
                    self._poll_timer.pause()
            self.update_labels()

    def _wake(self) -> None:
        """A command is on its way to the engine thread: from this UI, or (`serve --tui`) the server's."""
        if threading.get_ident() != self._ui_thread:
            self._ui_loop.call_soon_threadsafe(self._wake)
            return
        self._quiet_polls = 0
        if self._poll_timer is not None:
            self._poll_timer.resume()

    def redraw_panel(self) -> None:
        if self._snapshot is not None:
            self.source.draw(self._panel, self._snapshot, self.tabs.tag_of)

    def update_labels(self) -> None:
        self.tab_labels.update(self.tabs.panes, self._snapshot, self.theme)

    # -- commands ----------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in CHAT_ACTIONS and (self.chat is None or isinstance(self.screen, LoadingScreen)
                                       or self.screen.is_modal):
            return False
        return action != self._f5_action_off()

    def _f5_action_off(self) -> str:
        """Of f5's two actions, the one that is off now."""
        return "pause" if self.teaching.paused else "resume"

    def get_system_commands(self, screen: Screen):
        for command in super().get_system_commands(screen):
            if command.title != "Theme":  # ours below, limited to pagedchat's themes
                yield command
        if self.chat is None:
            return
        for binding in self.BINDINGS:
            if binding.action in CHAT_ACTIONS and binding.action != self._f5_action_off():
                yield SystemCommand(binding.description, f"{binding.description} ({binding.key})",
                                    lambda action=binding.action: self.run_action(action))
        yield SystemCommand("Demo: start/stop", "Tabs that chat by themselves from built-in prompts",
                            self.action_toggle_demo)
        if (pane := self.current_pane) is not None and pane.full and pane.conversation.num_tokens:
            yield SystemCommand("Continue in a new tab", "This full chat's system prompt and latest turns, in a branch",
                                lambda: self.tabs.carry_on(pane))
        for name in load_themes():
            yield SystemCommand(f"Theme: {name}", f"Switch to the {name} theme",
                                lambda name=name: setattr(self, "theme", name))
