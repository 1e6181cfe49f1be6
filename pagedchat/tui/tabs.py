"""The chat tabs: a pane per conversation, each with its colour, and the closed ones ctrl+t can bring back."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual.widgets import TabbedContent

from pagedchat.engine.api.params import SamplingParams
from pagedchat.engine.chat import RequestKey
from pagedchat.history import SavedChat
from pagedchat.tui.chat_message import ChatMessage
from pagedchat.tui.chat_pane import ChatPane
from pagedchat.tui.chat_record import ChatRecord, params_of
from pagedchat.tui.conversation import Conversation, Turn
from pagedchat.tui.edit_screen import EditScreen
from pagedchat.tui.message_box import MessageBox
from pagedchat.tui.themes import SESSION_COLOURS, SessionTag
from pagedchat.tui.worker import WidgetSink

if TYPE_CHECKING:
    from pagedchat.tui.app import PagedChatApp

CLOSED_KEPT = 20  # closed tabs that ctrl+t can bring back, the last closed first


@dataclass(frozen=True, slots=True)
class ClosedChat:
    conversation: Conversation
    title: str
    record: ChatRecord | None
    draft: str


class ChatTabs:
    """`params`: the sampling of new tabs. A tab's key is its pane's id and its requests' conversation
    (`RequestKey`); keys are never reused."""

    def __init__(self, app: "PagedChatApp", params: SamplingParams) -> None:
        self.panes: dict[str, ChatPane] = {}  # the open tabs, by key, in the order opened
        self._app = app
        self._params = params
        self._tags: dict[str, SessionTag] = {}  # every tab opened, by key
        self._opened = 0
        self._closed: list[ClosedChat] = []

    @property
    def tabbed(self) -> TabbedContent:
        return self._app.query_one("#chats", TabbedContent)

    @property
    def current(self) -> ChatPane | None:
        pane = self.tabbed.active_pane
        return pane if isinstance(pane, ChatPane) else None

    def tag_of(self, request_id: str) -> SessionTag:
        """A request's tab, open or closed (the event log still names a closed tab's blocks); a sample
        of a reply with n > 1 (`seq_id` `...#i`) is the tab's name and `#i`."""
        key = RequestKey.parse(request_id)
        tag = self._tags.get(key.conversation) if key else None
        if tag is None:
            return SessionTag.fallback(request_id)
        return tag._replace(name=f"{tag.name} #{key.sample}") if key.sample else tag

    def new_conversation(self, system_prompt: str | None = None,
                         params: SamplingParams | None = None) -> tuple[Conversation, str]:
        """A conversation for a new tab, and the tab's title."""
        conversation = Conversation(self._app.chat.new_session, self._next_key(), system_prompt, params or self._params)
        return conversation, f"chat {self._opened}"

    def _next_key(self) -> str:
        self._opened += 1
        return f"chat-{self._opened}"

    async def open(self, conversation: Conversation, title: str, record: bool | ChatRecord = True) -> ChatPane:
        """A tab on show for the conversation. `record`: whether to keep the chat in the history, or the
        record it already has there."""
        app = self._app
        used = {pane.colour for pane in self.panes.values()}
        colour = next((c for c in range(SESSION_COLOURS) if c not in used), self._opened % SESSION_COLOURS)
        chat_record = record if isinstance(record, ChatRecord) else \
            ChatRecord(app.history, conversation, title) if app.history and record else None
        # Labelled in full from the start: the tab underline takes the label's width once, when the
        # tab is activated, and would keep a shorter first label's width.
        label = app.tab_labels.label(title, colour, conversation.num_tokens)
        pane = ChatPane(conversation, title, colour, app.chat, chat_record, label)
        self.panes[conversation.key] = pane
        self._tags[conversation.key] = SessionTag(title, colour)
        app.redraw_panel()  # the panel names and colours requests by their tabs
        await self.tabbed.add_pane(pane)
        self.tabbed.active = pane.id
        self.focus_box(pane)
        app.update_labels()
        return pane

    async def new(self) -> ChatPane:
        return await self.open(*self.new_conversation())

    async def close(self, pane: ChatPane) -> None:
        draft = pane.close()
        del self.panes[pane.id]
        self._app.tab_labels.forget(pane.id)
        if not self._app.demo.forget(pane.id) and (pane.conversation.turns or draft):
            self._closed = [ClosedChat(pane.conversation, pane.title, pane.record, draft), *self._closed][:CLOSED_KEPT]
            self._app.notify(f"Closed {pane.title}: ctrl+t reopens it.")
        await self.tabbed.remove_pane(pane.id)
        if not self.panes:
            await self.new()

    async def reopen(self) -> None:
        if not self._closed:
            self._app.notify("No closed chat to reopen.", severity="warning")
            return
        closed, *self._closed = self._closed
        if closed.record is not None:
            closed.record.reopen()
        # Its engine request was closed with the tab: the next turn sends the whole conversation again,
        # served from the prefix cache where it can.
        await self.open(closed.conversation.fork(self._next_key()), closed.title, closed.record or False)
        self.carry_over(closed.draft, sent=False)

    async def fork(self, source: ChatPane) -> ChatPane | None:
        """A new tab with the source's history, its blocks shared; None (and a notice why) if it cannot be."""
        chat = self._app.chat
        if source.conversation.request_id is None:
            self._app.notify("Nothing to fork yet: send a message first.", severity="warning")
            return None
        if source.replying and not chat.forks_replies:
            self._app.notify("A server cannot fork a reply in progress: wait for it, or stop it (escape), "
                             "then fork.", severity="warning")
            return None
        twin = source.conversation.fork(self._next_key())
        pane = await self.open(twin, f"{source.title}′", self._saved(source))
        chat.fork(source.conversation.request_id, twin.request_id, WidgetSink(pane))
        if source.replying:
            pane.start_forked_reply(source.reply_text)
        return pane

    def edit(self, source: ChatPane) -> None:
        """Pick one of the tab's messages: a new tab holds the turns before it, and its text to edit."""
        # The turns as they are now: a reply may end (or fail) while the list is up. Every turn before
        # a user message has finished, even while the last one's reply streams.
        turns = list(source.conversation.turns)
        messages = [(index, turn.text) for index, turn in enumerate(turns) if turn.role == "user"]
        if not messages:
            self._app.notify("No message to edit yet: send one first.", severity="warning")
            return

        async def edit(index: int | None) -> None:
            if index is not None:
                await self.open(source.conversation.branch(self._next_key(), turns[:index]), f"{source.title} (edit)",
                                self._saved(source))
                self.carry_over(turns[index].text, sent=False)

        self._app.push_screen(EditScreen(source.title, messages), edit)

    @staticmethod
    def _saved(source: ChatPane) -> bool:
        """Whether a tab made from the source (a fork, an edit) is kept in the history: as the source is,
        so nothing of a demo is saved."""
        return source.record is not None

    async def restore(self, saved: list[SavedChat], restore: bool) -> None:
        """The chats open when the app last quit: as tabs (`restore`), or closed in the history."""
        history = self._app.history
        for chat in saved:
            if restore:  # the replies' own tokens were not saved: the session tokenizes their text
                conversation, _ = self.new_conversation(chat.system_prompt, params_of(chat.settings, self._params))
                conversation.restore([Turn(m["role"], m["content"]) for m in chat.messages])
                await self.open(conversation, chat.title)
            history.close_chat(chat.chat_id)  # a restored tab lives on as a new chat
        if not self.panes:
            await self.new()

    async def carry_on(self, source: ChatPane) -> ChatPane:
        """A full tab goes on in a new one (a branch: the full tab stays whole) with its system prompt and
        the latest turns that fit in half the context with the message it refused, which is then sent.
        Those turns sit at new positions, so the prefix cache cannot serve them: the notice says what
        is computed again."""
        box = source.query_one(MessageBox)
        message = box.text.strip()
        budget = (source.max_len or 0) // 2
        twin, shared = source.conversation.carry_on(self._next_key(), budget, message)
        pane = await self.open(twin, f"{source.title} (cont.)")
        box.clear()
        recomputed = twin.num_tokens - shared
        note = (f"*Continued from {source.title}, which stays as it was: the system prompt and the latest "
                f"{len(twin.turns)} of its {len(source.conversation.turns)} turns, {twin.num_tokens} tokens. "
                f"Those turns now sit at other positions, so the prefix cache cannot serve them: "
                f"{recomputed} tokens are computed again (of the {shared} both chats begin with, the whole "
                f"blocks can come from it).*")
        await pane.query_one("#transcript").mount(ChatMessage("notice", note))
        self._app.notify(f"Continued in {pane.title}: {recomputed} tokens of kept turns are computed again.")
        self.carry_over(message, sent=True)
        return pane

    def carry_over(self, text: str, sent: bool) -> None:
        """Text typed elsewhere (the loading screen, an edited message, a closed tab's draft) reaches the
        tab on show: a message sent is sent (or stays in the box, with the tab's notice why, if the tab
        refuses it); a draft waits in the box."""
        pane = self.current
        if not text or pane is None or (sent and pane.send(text)):
            return
        box = pane.query_one(MessageBox)
        box.text = text
        box.move_cursor(box.document.end)

    @staticmethod
    def focus_box(pane: ChatPane) -> None:
        # Screen.set_focus now, not Widget.focus(), which focuses later (call_later), when the
        # active tab may have moved on: focusing then would switch the tab back. The box's own
        # screen, not the app's: the first tab opens while the loading screen is still on top.
        box = pane.query_one(MessageBox)
        if box.screen.focused is not box:
            box.screen.set_focus(box)
