"""The app: chat tabs on the left, the KV panel on the right, one engine thread behind them."""

import asyncio
import copy
import gc
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import platformdirs
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Container, Horizontal
from textual.content import Content
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, TabbedContent, Tabs

from pagedchat.engine.api.errors import one_line
from pagedchat.engine.runtime.engine_thread import EngineThread
from pagedchat.engine.runtime.own_thread import in_own_thread
from pagedchat.engine.api.params import SamplingParams
from pagedchat.engine.api.snapshot import KVSnapshot
from pagedchat.history import History, SavedChat
from pagedchat.tui.chat_backend import ChatBackend, LocalChat
from pagedchat.tui.chat_pane import ChatPane
from pagedchat.tui.chat_record import ChatRecord
from pagedchat.tui.conversation import DEFAULT_PARAMS, Conversation, Turn
from pagedchat.tui.demo import PROMPTS as DEMO_PROMPTS
from pagedchat.tui.demo import SCENES
from pagedchat.tui.demo import SYSTEM_PROMPT as DEMO_SYSTEM_PROMPT
from pagedchat.tui.demo import demo_scripts
from pagedchat.tui.edit_screen import EditScreen
from pagedchat.tui.engine_badge import EngineBadge
from pagedchat.tui.frame_budget import FrameBudget
from pagedchat.tui.help_screen import HelpScreen
from pagedchat.tui.kv_panel import KVPanel
from pagedchat.tui.loading_screen import LoadingScreen
from pagedchat.tui.message_box import MessageBox
from pagedchat.tui.restore_screen import RestoreScreen
from pagedchat.tui.settings_screen import SettingsScreen, TabSettings
from pagedchat.tui.themes import DEFAULT_THEME, SESSION_COLOURS, SessionTag, load_themes
from pagedchat.tui.worker import WidgetSink

if TYPE_CHECKING:
    from pagedchat.attach.watch import LogicalSnapshot
    from pagedchat.tui.attached import AttachTarget

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClosedChat:
    conversation: Conversation
    title: str
    record: ChatRecord | None
    draft: str

POLL_HZ = 10
UI_CPU_SHARE = 0.03  # of a core: the UI thread's while the engine works, drawing gives way (frame_budget.py)
MAX_DRAW_GAP_S = 1.5 / POLL_HZ  # while the engine runs, a draw at least every other tick (half a tick spare)
PANEL_EVERY_S = 0.4  # the KV panel's redraws while the engine runs (teaching mode: every step)
LABEL_COUNT_EVERY_S = 0.5  # a streaming tab's count relabels at most this often: at most a second old
SLOW_MOTION = (0.0, 0.25, 1.0)  # seconds between steps, cycled by f3
STATES = {"waiting": "waiting", "running": "generating", "preempted": "preempted"}
STATE_WIDTH = max(map(len, STATES.values()))
# A compact tab label's mark, in its session's colour, where a full one has "■": 4 compact tabs fit in 40 columns.
STATE_MARKS = {"idle": "■", "waiting": "⋯", "generating": "▸", "preempted": "‖"}
CLOSED_KEPT = 20  # closed tabs that ctrl+t can bring back, the last closed first
# Actions that belong to the chat screen: off while a dialog or the loading screen is up, so that
# escape and friends reach the dialog despite being priority bindings.
CHAT_ACTIONS = {"new_chat", "close_chat", "reopen_chat", "fork_chat", "edit_message", "stop", "regenerate", "pause",
                "resume", "step", "slow_motion", "settings", "copy_reply", "export_chat", "previous_tab", "next_tab",
                "toggle_demo", "toggle_panel", "toggle_contiguous"}


class PagedChatApp(App):
    """`load_llm` builds the `LLM` (in a worker thread, after the screen opens); with `attach` the tabs
    chat with that server instead, and no model is loaded."""

    CSS_PATH = "app.tcss"
    TITLE = "pagedchat"
    AUTO_FOCUS = "MessageBox"

    BINDINGS = [
        Binding("ctrl+n", "new_chat", "New chat", priority=True),
        Binding("ctrl+w", "close_chat", "Close", priority=True),
        Binding("ctrl+t", "reopen_chat", "Reopen closed chat", priority=True, show=False),
        Binding("ctrl+f", "fork_chat", "Fork", priority=True),
        Binding("ctrl+o", "edit_message", "Edit an earlier message", priority=True, show=False),
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+r", "regenerate", "Regenerate", priority=True),
        # f5 has two bindings, one shown at a time (check_action): the footer says what f5 will do.
        Binding("f5", "pause", "Pause", priority=True),
        Binding("f5", "resume", "Resume", priority=True),
        Binding("f6", "step", "Step", priority=True),
        Binding("f3", "slow_motion", "Slow motion", priority=True, show=False),
        Binding("f2", "settings", "Settings", priority=True),
        Binding("f4", "toggle_panel", "Panel", priority=True),
        Binding("f9", "toggle_contiguous", "Contiguous view", priority=True, show=False),
        Binding("f1", "help", "Help", priority=True),
        Binding("ctrl+y", "copy_reply", "Copy last reply", priority=True, show=False),
        Binding("ctrl+e", "export_chat", "Export as Markdown", priority=True, show=False),
        Binding("ctrl+pageup,alt+left,f7", "previous_tab", "Previous tab", priority=True, show=False,
                key_display="ctrl+pgup / alt+← / f7"),
        Binding("ctrl+pagedown,alt+right,f8", "next_tab", "Next tab", priority=True, show=False,
                key_display="ctrl+pgdn / alt+→ / f8"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, load_llm: Callable[[], object] | None, *, model_name: str = "the model",
                 attach: "AttachTarget | None" = None,
                 theme: str = DEFAULT_THEME, demo: str | None = None, params: SamplingParams = DEFAULT_PARAMS,
                 history: History | None = None,
                 on_engine: Callable[[object, EngineThread], None] | None = None) -> None:
        """`on_engine(llm, worker)`: told once the engine thread runs (`serve --tui` serves it too)."""
        super().__init__()
        self.history = history  # None: nothing is saved (--no-history)
        self._on_engine = on_engine
        for theme_obj in load_themes().values():
            self.register_theme(theme_obj)
        self.theme = theme
        self.worker: EngineThread | None = None  # the local engine's thread
        self.chat: ChatBackend | None = None  # what the tabs chat with
        self.load_error: str | None = None  # why loading failed, for the one line the CLI prints
        self._load_llm = load_llm
        self.attached = None
        if attach is not None:  # the attach extra's packages are imported only when attaching
            from pagedchat.tui.attached import Attached

            self.attached = Attached(attach)
        self._model_name = model_name
        self._params = params  # sampling of new tabs
        self.tokenizer = None  # the UI thread's own (_load_with_tokenizer)
        self._max_len: int | None = None
        self._panes: dict[str, ChatPane] = {}
        self._tabs_opened = 0
        self._labels: dict[str, tuple] = {}  # tab id: (title, theme, state), token count as shown
        self._counts_shown_at = 0.0
        self._snapshot: "KVSnapshot | LogicalSnapshot | None" = None
        self._poll_timer: Timer | None = None
        self._quiet_polls = 0
        self._panel_drawn_at = -math.inf
        self._frame_budget = FrameBudget(UI_CPU_SHARE, MAX_DRAW_GAP_S)
        self._demo_on = demo is not None
        self._scene = SCENES[demo or "chat"]  # a scene's name (pagedchat.tui.demo); the palette starts "chat"
        self._demo_scripts = demo_scripts()
        self._demo_tabs: dict[str, Iterator[str]] = {}
        self._forks_due = 0  # forks the scene still makes of its first tab
        self._closed_chats: list[ClosedChat] = []
        self._tags: dict[str, SessionTag] = {}  # every tab opened, by key

    def get_theme_variable_defaults(self) -> dict[str, str]:
        # Textual's own themes lack the session and block colours: borrow the default theme's.
        return dict(load_themes()[DEFAULT_THEME].variables)

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            with Container(id="chat-area"):
                yield TabbedContent(id="chats")
                yield EngineBadge()
            yield KVPanel()
        yield Footer()

    def on_mount(self) -> None:
        self._ui_loop, self._ui_thread = asyncio.get_running_loop(), threading.get_ident()
        # kill -TERM, or the terminal closing (HUP): quit the normal way, so the terminal is restored.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self.exit)
        if self.attached:
            self.push_screen(LoadingScreen(self.attached.target.url, doing="connecting to"))
            self._attach()
        else:
            self.push_screen(LoadingScreen(self._model_name))
            self._load()

    async def on_unmount(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        if self.attached is not None:
            await self.attached.close()
        gc.unfreeze()  # a process that goes on (tests, benchmarks) can collect what the app held

    # -- loading -----------------------------------------------------------------------------------

    @work(exit_on_error=False)
    async def _load(self) -> None:
        # The loading runs in a thread and the result comes back here by await, not by
        # call_from_thread, which would block the thread forever if the app quit meanwhile.
        try:
            llm, self.tokenizer = await in_own_thread(self._load_with_tokenizer)
        except Exception as exc:
            log.exception("loading the model failed")
            self.load_error = one_line(exc)
            self.exit(return_code=1)
            return
        # The model, torch and transformers leave ~450,000 objects that live as long as the app.
        # Textual's garbage soon triggers a full collection, which walks them all (~220 ms here) in
        # whichever thread it hits, the engine's included: freeze them out of every collection (after
        # one last collection, so that the loading's own garbage is not frozen with them).
        gc.collect()
        gc.freeze()
        engine = llm.engine
        self._max_len = engine.config.max_model_len
        self.worker = EngineThread(engine, on_command=self._wake)
        self.worker.start()
        self.chat = LocalChat(self.worker, self.tokenizer, self._max_len)
        if self._on_engine is not None:
            self._on_engine(llm, self.worker)
        await self._open_first_tabs()

    @work(exit_on_error=False)
    async def _attach(self) -> None:
        attached = self.attached
        try:
            await attached.connect()
        except Exception as exc:
            log.exception("attaching to %s failed", attached.target.url)
            self.load_error = one_line(exc)
            self.exit(return_code=1)
            return
        self.chat = attached.chat
        self._max_len = attached.chat.max_len
        if not attached.grid:
            await self.query_one(KVPanel).remove()
            await self.query_one("#main").mount(attached.panel())
        attached.when_text_arrives(self._redraw_panel)
        await self._open_first_tabs()

    async def _open_first_tabs(self) -> None:
        self._poll_timer = self.set_interval(1 / POLL_HZ, self._poll)
        saved = self.history.open_chats() if self.history and not self._demo_on else []
        if saved:
            typed = await self._close_loading()
            self.push_screen(RestoreScreen(saved), lambda restore: self._restore(saved, restore, typed))
            return
        # The first tabs open under the loading screen, whose message box takes the keys meanwhile.
        if self._demo_on:
            await self._start_demo()
        else:
            await self.action_new_chat()
        self._carry_over(*await self._close_loading())

    def _load_with_tokenizer(self) -> tuple[object, object]:
        """The LLM, and the UI thread's own copy of its tokenizer: the engine thread decodes with the
        engine's, and fast tokenizers are not thread-safe."""
        llm = self._load_llm()
        return llm, copy.deepcopy(llm.get_tokenizer())

    async def _close_loading(self) -> tuple[str, bool]:
        """Pop the loading screen (the main screen has focus back once this returns): what the user
        typed there, and whether they sent it."""
        loading = self.screen
        assert isinstance(loading, LoadingScreen)
        typed = loading.typed, loading.sent
        await self.pop_screen()
        # A tab added under the loading screen may have been measured before the main screen's first
        # layout, leaving its underline at zero width; Textual's Tabs place it again only on a resize
        # or a change of tab, and offer no public call for it.
        if self._tabbed.tab_count:
            self.call_after_refresh(self._tabbed.query_one(Tabs)._highlight_active, False)
        return typed

    def _carry_over(self, text: str, sent: bool) -> None:
        """What the user typed while the model loaded reaches the tab on show: a message they sent
        is sent (or stays in the box, with the tab's notice why, if the tab refuses it); a draft
        waits in the box."""
        pane = self.current_pane
        if not text or pane is None or (sent and pane.send(text)):
            return
        box = pane.query_one(MessageBox)
        box.text = text
        box.move_cursor(box.document.end)

    async def _restore(self, saved: list[SavedChat], restore: bool, typed: tuple[str, bool]) -> None:
        for chat in saved:
            if restore:
                conversation, _ = self._new_conversation(chat.system_prompt, self._params_of(chat.settings))
                # The replies' own tokens were not saved: the restored turn re-tokenizes their text.
                conversation.restore([Turn(m["role"], m["content"], tuple(self.tokenizer.encode(
                    m["content"], add_special_tokens=False)) if m["role"] == "assistant" else ())
                    for m in chat.messages])
                await self._open(conversation, chat.title)
            self.history.close_chat(chat.chat_id)  # a restored tab lives on as a new chat
        if not self._panes:
            await self.action_new_chat()
        self._carry_over(*typed)

    def _params_of(self, settings: dict) -> SamplingParams:
        """A saved tab's sampling: the app's, with the settings the tab saved (chat_record.settings_of);
        a setting it has not saved (an older history's penalties) stays the app's."""
        from pagedchat.tui.chat_record import SAVED_SETTINGS

        try:
            return replace(self._params, **{name: settings[name] for name in SAVED_SETTINGS if name in settings})
        except (TypeError, ValueError):  # settings a user could not have saved: the defaults
            return self._params

    # -- tabs --------------------------------------------------------------------------------------

    @property
    def _tabbed(self) -> TabbedContent:
        return self.query_one("#chats", TabbedContent)

    @property
    def current_pane(self) -> ChatPane | None:
        pane = self._tabbed.active_pane
        return pane if isinstance(pane, ChatPane) else None

    async def _open(self, conversation: Conversation, title: str, record: bool | ChatRecord = True) -> ChatPane:
        """`record`: whether to keep the chat in the history, or the record it already has there."""
        used = {pane.colour for pane in self._panes.values()}
        colour = next((c for c in range(SESSION_COLOURS) if c not in used), self._tabs_opened % SESSION_COLOURS)
        chat_record = record if isinstance(record, ChatRecord) else \
            ChatRecord(self.history, conversation, title) if self.history and record else None
        # Labelled in full from the start: the tab underline takes the label's width once, when the
        # tab is activated, and would keep a shorter first label's width.
        label = self._tab_label(title, colour, conversation.num_tokens, "idle")
        pane = ChatPane(conversation, title, colour, self.chat, chat_record, label)
        self._panes[conversation.key] = pane
        self._tags[conversation.key] = SessionTag(title, colour)
        if self._snapshot is not None:  # the panel names and colours requests by their tabs
            self._redraw_panel()
        await self._tabbed.add_pane(pane)
        self._tabbed.active = pane.id
        self._focus_box(pane)
        self._update_labels()
        return pane

    def _next_key(self) -> str:
        """A new tab's key: widget ids and request ids are never reused."""
        self._tabs_opened += 1
        return f"chat-{self._tabs_opened}"

    def _new_conversation(self, system_prompt: str | None = None,
                          params: SamplingParams | None = None) -> tuple[Conversation, str]:
        conversation = Conversation(self.chat.new_session, self._next_key(), system_prompt, params or self._params)
        return conversation, f"chat {self._tabs_opened}"

    async def action_new_chat(self) -> None:
        await self._open(*self._new_conversation())

    async def action_close_chat(self) -> None:
        pane = self.current_pane
        if pane is None:
            return
        draft = pane.close()
        del self._panes[pane.id]
        self._labels.pop(pane.id, None)
        if self._demo_tabs.pop(pane.id, None) is None and (pane.conversation.turns or draft):
            closed = ClosedChat(pane.conversation, pane.title, pane.record, draft)
            self._closed_chats = [closed, *self._closed_chats][:CLOSED_KEPT]
            self.notify(f"Closed {pane.title}: ctrl+t reopens it.")
        await self._tabbed.remove_pane(pane.id)
        if not self._panes:
            await self.action_new_chat()

    async def action_reopen_chat(self) -> None:
        if not self._closed_chats:
            self.notify("No closed chat to reopen.", severity="warning")
            return
        closed, *self._closed_chats = self._closed_chats
        if closed.record is not None:
            closed.record.reopen()
        # Its engine request was closed with the tab: the next turn sends the whole conversation again,
        # served from the prefix cache where it can.
        conversation = closed.conversation.fork(self._next_key())
        await self._open(conversation, closed.title, closed.record or False)
        self._carry_over(closed.draft, sent=False)

    async def action_fork_chat(self) -> None:
        if (source := self.current_pane) is not None:
            await self._fork(source)

    async def _fork(self, source: ChatPane) -> ChatPane | None:
        """A new tab with the source's history, its blocks shared; None (and a notice why) if it cannot be."""
        if source.conversation.request_id is None:
            self.notify("Nothing to fork yet: send a message first.", severity="warning")
            return None
        if source.replying and not self.chat.forks_replies:
            self.notify("A server cannot fork a reply in progress: wait for it, or stop it (escape), then fork.",
                        severity="warning")
            return None
        twin = source.conversation.fork(self._next_key())
        pane = await self._open(twin, f"{source.title}′")
        self.chat.fork(source.conversation.request_id, twin.request_id, WidgetSink(pane))
        if source.replying:
            pane.start_forked_reply(source.reply_text)
        return pane

    def action_edit_message(self) -> None:
        """Pick one of the tab's messages: a new tab holds the turns before it, and its text to edit."""
        if (source := self.current_pane) is None:
            return
        # The turns as they are now: a reply may end (or fail) while the list is up. Every turn before
        # a user message has finished, even while the last one's reply streams.
        turns = list(source.conversation.turns)
        messages = [(index, turn.text) for index, turn in enumerate(turns) if turn.role == "user"]
        if not messages:
            self.notify("No message to edit yet: send one first.", severity="warning")
            return

        async def edit(index: int | None) -> None:
            if index is not None:
                branch = source.conversation.branch(self._next_key(), turns[:index])
                await self._open(branch, f"{source.title} (edit)")
                self._carry_over(turns[index].text, sent=False)

        self.push_screen(EditScreen(source.title, messages), edit)

    def action_previous_tab(self) -> None:
        self._tabbed.query_one(Tabs).action_previous_tab()

    def action_next_tab(self) -> None:
        self._tabbed.query_one(Tabs).action_next_tab()

    async def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        # A stale activation (the tab changed again since) must not pull focus back to its pane:
        # focusing a pane activates its tab, and two such messages in flight would ping-pong. One
        # that arrives while the app closes finds the widgets gone (is_attached is False then).
        pane = event.pane
        if isinstance(pane, ChatPane) and pane.is_attached and pane.id == event.tabbed_content.active:
            self._focus_box(pane)
            await pane.draw()  # its reply as it is now, in the frame that shows the tab, not a draw later

    def _focus_box(self, pane: ChatPane) -> None:
        # Screen.set_focus now, not Widget.focus(), which focuses later (call_later), when the
        # active tab may have moved on: focusing then would switch the tab back. The box's own
        # screen, not the app's: the first tab opens while the loading screen is still on top.
        box = pane.query_one(MessageBox)
        if box.screen.focused is not box:
            box.screen.set_focus(box)

    # -- the current conversation ------------------------------------------------------------------

    def action_stop(self) -> None:
        if (pane := self.current_pane) is not None:
            pane.stop()

    def action_regenerate(self) -> None:
        if (pane := self.current_pane) is not None:
            pane.regenerate()

    def action_copy_reply(self) -> None:
        pane = self.current_pane
        reply = pane.conversation.last_reply if pane else None
        if reply is None:
            self.notify("No reply to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(reply.text)
        self.notify(f"Copied {len(reply.text)} characters.")

    def action_export_chat(self) -> None:
        pane = self.current_pane
        if pane is None or not pane.conversation.turns:
            self.notify("Nothing to export yet.", severity="warning")
            return
        # The documents folder, not the current directory (wherever the app was started from);
        # platformdirs honours XDG_DOCUMENTS_DIR and the user-dirs.dirs file.
        path = platformdirs.user_documents_path() / "pagedchat" / f"{pane.id}-{time.strftime('%Y%m%d-%H%M%S')}.md"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(pane.conversation.markdown(pane.title), encoding="utf-8")
        except OSError as exc:
            self.notify(f"Could not export the chat to {path}: {one_line(exc)}", severity="error")
            return
        self.notify(f"Saved the chat to {path}")

    def action_settings(self) -> None:
        pane = self.current_pane
        if pane is None:
            return
        settings = TabSettings(pane.conversation.system_prompt, pane.conversation.params)
        self.push_screen(SettingsScreen(pane.title, settings), pane.apply_settings)

    def action_toggle_panel(self) -> None:
        """Hide the KV panel (the chat takes the whole width) or show it again."""
        panel = self.query_one("#main > KVPanel, #main > LogicalPanel")
        panel.display = not panel.display
        self.notify("KV panel shown." if panel.display else "KV panel hidden: f4 shows it again.")

    def action_toggle_contiguous(self) -> None:
        for panel in self.query(KVPanel):  # none when attached to a server that sends no grid
            self.notify("Contiguous view shown: a model." if panel.toggle_contiguous() else "Contiguous view hidden.")

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    # -- teaching mode -----------------------------------------------------------------------------

    def action_pause(self) -> None:
        self._set_paused(True)

    def action_resume(self) -> None:
        self._set_paused(False)

    def _local_engine(self) -> bool:
        """Teaching mode drives the local engine; an attached server's engine runs on its own."""
        if self.worker is None:
            self.notify("Pause, step and slow motion work on the local engine only: "
                        "an attached server's engine runs on its own.", severity="warning")
        return self.worker is not None

    def _set_paused(self, paused: bool) -> None:
        if not self._local_engine():
            return
        self.worker.set_paused(paused)
        self.notify("Engine paused: f6 runs one step, f5 resumes." if paused else "Engine resumed.")
        self._show_teaching_state()

    def _show_teaching_state(self) -> None:
        """The badge and f5's footer entry follow the pause and slow motion: only when they change
        (the badge lays out its own layer; the footer recomposes)."""
        self.query_one(EngineBadge).show_state(self.worker.paused, self.worker.delay)
        self.query_one(KVPanel).set_step_marks(self.worker.paused or bool(self.worker.delay))
        self.refresh_bindings()

    def _f5_action_off(self) -> str:
        """Of f5's two actions, the one that is off now."""
        return "pause" if self.worker is not None and self.worker.paused else "resume"

    def action_step(self) -> None:
        if not self._local_engine():
            return
        if not self.worker.paused:
            self.notify("f6 runs one step while the engine is paused (f5).", severity="warning")
            return
        self.worker.step_once()

    def action_slow_motion(self) -> None:
        if not self._local_engine():
            return
        delay = SLOW_MOTION[(SLOW_MOTION.index(self.worker.delay) + 1) % len(SLOW_MOTION)] \
            if self.worker.delay in SLOW_MOTION else 0.0
        self.worker.set_delay(delay)
        self.notify(f"Slow motion: {delay:g} s between steps." if delay else "Slow motion off.")
        self._show_teaching_state()

    # -- demo --------------------------------------------------------------------------------------

    async def _start_demo(self) -> None:
        self._demo_on = True
        if not self._demo_tabs:
            for index in range(self._scene.tabs):
                await self._open_demo_tab(index)
            self._forks_due = self._scene.forks
        if not hasattr(self, "_demo_timer"):
            self._demo_timer = self.set_interval(1.0, self._demo_tick)

    async def _open_demo_tab(self, index: int = 0) -> None:
        scene = self._scene
        prompt = DEMO_SYSTEM_PROMPT if scene.shared_prompt else DEMO_PROMPTS[index % len(DEMO_PROMPTS)]
        params = replace(scene.params, n=scene.samples) if index == scene.tabs - 1 else scene.params
        conversation, title = self._new_conversation(prompt, params)
        self._demo_tabs[conversation.key] = next(self._demo_scripts)
        await self._open(conversation, f"demo {title.split()[-1]}", record=False)  # demo chats are not kept

    async def _fork_demo_tab(self, key: str) -> None:
        """The sharing scene: forks of the first tab, which go on with questions of their own."""
        for _ in range(self._forks_due):
            if (fork := await self._fork(self._panes[key])) is not None:
                self._demo_tabs[fork.id] = next(self._demo_scripts)
        self._forks_due = 0

    async def action_toggle_demo(self) -> None:
        if self._demo_on:
            self._demo_on = False
            self.notify("Demo stopped: the tabs finish their replies and wait.")
        else:
            await self._start_demo()

    async def _demo_tick(self) -> None:
        if not self._demo_on:
            return
        first = next(iter(self._demo_tabs), None)
        if self._forks_due and first is not None and self._panes[first].conversation.last_reply is not None:
            await self._fork_demo_tab(first)
        for key, script in list(self._demo_tabs.items()):
            pane = self._panes[key]
            if pane.full:  # the conversation filled the context: start over in a fresh tab
                self._tabbed.active = key
                await self.action_close_chat()
                await self._open_demo_tab()
            elif not pane.replying:
                pane.send(next(script))

    # -- the picture -------------------------------------------------------------------------------

    async def _poll(self) -> None:
        """The UI's tick: the panel, the tab labels and the reply on show change together, in one
        frame, as often as the frame budget allows while the engine runs (each frame costs the
        engine a slice of a core and of the GIL)."""
        if not self.is_running:  # shutting down: the widgets are going away
            return
        for pane in self._panes.values():
            pane.catch_up()  # every tab keeps its reply in progress (and its saved copy) current
        # The budget guards a running engine; in teaching mode each step is drawn at once.
        teaching = self.worker is not None and (self.worker.paused or self.worker.delay)
        if not self._frame_budget.due() and not teaching:
            return
        with self.batch_update():  # one frame for all of it
            if (pane := self.current_pane) is not None:
                await pane.draw()
            snapshot = self.attached.snapshot if self.attached else self.worker.snapshot
            if snapshot is not self._snapshot:
                self._quiet_polls = 0
                # Repainting the panel is most of a frame's cost: while replies stream, it follows
                # at PANEL_EVERY_S, the reply on show at every draw.
                now = time.monotonic()
                if teaching or now - self._panel_drawn_at >= PANEL_EVERY_S:
                    self._snapshot, self._panel_drawn_at = snapshot, now
                    self._redraw_panel()
            elif self.worker is not None and not any(pane.replying for pane in self._panes.values()):
                # The engine moves only on a command (`_wake`): after a quiet second, stop polling
                # until the next command (`_wake`), so an idle app costs nothing.
                self._quiet_polls += 1
                if self._quiet_polls > POLL_HZ:
                    self._poll_timer.pause()
            self._update_labels()

    def _wake(self) -> None:
        """A command is on its way to the engine thread: from this UI, or (`serve --tui`) the server's."""
        if threading.get_ident() != self._ui_thread:
            self._ui_loop.call_soon_threadsafe(self._wake)
            return
        self._quiet_polls = 0
        if self._poll_timer is not None:
            self._poll_timer.resume()

    def _tag_of(self, request_id: str) -> SessionTag:
        """A request's tab, open or closed (the event log still names a closed tab's blocks)."""
        return self._tags.get(request_id.rsplit(".", 1)[0]) or SessionTag.fallback(request_id)

    def _redraw_panel(self) -> None:
        snapshot = self._snapshot
        if isinstance(snapshot, KVSnapshot):
            self.query_one(KVPanel).show(snapshot, self._tag_of, self._decode)
        elif snapshot is not None:  # an attached vLLM's logical view
            self.query_one("LogicalPanel").show(snapshot, self.attached.contexts(), self._tag_of)

    def _decode(self, token_ids: list[int]) -> str:
        return self.attached.decode(token_ids) if self.attached else self.tokenizer.decode(token_ids)

    def _update_labels(self) -> None:
        infos = {info.request_id: info for info in self._snapshot.requests} \
            if isinstance(self._snapshot, KVSnapshot) else {}
        labels = {}
        compact = self._tabs_overflow()
        for key, pane in self._panes.items():
            info = infos.get(pane.conversation.request_id)
            # Without the request in a snapshot (not stepped yet, or a server that publishes none), the
            # reply's own progress tells waiting from generating.
            progress = self.chat.progress(pane.conversation.request_id) if pane.replying else None
            status = info.status if info else "running" if progress and progress.token_ids else "waiting"
            state = STATES.get(status, "idle") if pane.replying else "idle"
            tokens = info.num_tokens if info else self.chat.num_tokens(pane.conversation.request_id) \
                if self.attached else pane.conversation.num_tokens
            labels[key] = ((pane.title, self.theme, state, compact), 0 if compact else tokens)
        changed = {key: label for key, label in labels.items() if self._labels.get(key) != label}
        # A relabel lays out the whole screen (~15 ms here), however many tabs it changes. While
        # replies stream, counts alone relabel every LABEL_COUNT_EVERY_S at most (the block tables
        # show them live), and all changed tabs go together; at rest a count is exact.
        now = time.monotonic()
        streaming_counts_only = all(key in self._labels and self._labels[key][0] == look and look[2] != "idle"
                                    for key, (look, _) in changed.items())
        if not changed or (streaming_counts_only and now - self._counts_shown_at < LABEL_COUNT_EVERY_S):
            return
        self._counts_shown_at = now
        self._labels |= changed
        for key, ((_, _, state, compact), tokens) in changed.items():
            pane = self._panes[key]
            self._tabbed.get_tab(key).label = self._tab_label(pane.title, pane.colour, tokens, state, compact)

    def _tabs_overflow(self) -> bool:
        """Whether the tabs' full labels would not all fit in the tab bar: then they are compact."""
        width = self._tabbed.size.width
        full = len(str(self._max_len)) + STATE_WIDTH + 12  # "■ ", " ", " tok · " and the tab's padding
        return width > 0 and sum(len(pane.title) + full for pane in self._panes.values()) > width

    def _tab_label(self, title: str, colour: int, tokens: int, state: str, compact: bool = False) -> Content:
        """The tab's colour, title, tokens and state; compact, the state's mark in the colour, and the title."""
        mark = STATE_MARKS[state] if compact else "■"
        label = Text(f"{mark} ", style=self.theme_variables[SessionTag(title, colour).variable])
        if compact:
            label.append(title)
            return Content.from_rich_text(label)
        label.append(f"{title} ")
        # Fixed-width fields: a tab that changes width shifts the tabs after it, and the active
        # tab's underline then slides there over some twenty frames.
        label.append(f"{tokens:>{len(str(self._max_len))}} tok · {state:<{STATE_WIDTH}}", style="dim")
        return Content.from_rich_text(label)

    # -- commands ----------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in CHAT_ACTIONS and (self.chat is None or isinstance(self.screen, (LoadingScreen,))
                                       or self.screen.is_modal):
            return False
        if action == self._f5_action_off():
            return False
        return True

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
        for name in load_themes():
            yield SystemCommand(f"Theme: {name}", f"Switch to the {name} theme",
                                lambda name=name: setattr(self, "theme", name))
