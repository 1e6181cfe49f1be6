"""One chat tab: a conversation kept resident in the engine, its transcript and its message box."""

import time
from pathlib import Path

import platformdirs
from textual import events
from textual.app import ComposeResult
from textual.content import Content
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Button, Static, TabPane

from pagedchat.engine.api.errors import one_line
from pagedchat.engine.api.outputs import CompletionOutput, RequestOutput
from pagedchat.tui.chat_backend import ChatBackend
from pagedchat.tui.chat_message import ChatMessage, visible
from pagedchat.tui.chat_record import ChatRecord
from pagedchat.tui.conversation import ContextFull, Conversation, MessageTooLong, Send
from pagedchat.tui.message_box import MessageBox
from pagedchat.tui.settings_screen import SettingsScreen, TabSettings
from pagedchat.tui.worker import EngineError, EngineOutput, WidgetSink

FINISH_NOTES = {"abort": "stopped", "length": "max tokens reached"}


def samples_note(samples: list[CompletionOutput]) -> str:
    """The samples after the first of an n > 1 reply: the chat goes on with the first, and the engine
    with each in a branch of its own (the KV panel's r#1, r#2, ...)."""
    others = "\n\n".join(f"**Sample {out.index + 1}:** {visible(out.text)}" for out in samples[1:])
    return (f"*{len(samples)} samples of this reply (n = {len(samples)}), sharing its prompt's blocks: the chat "
            f"shows the first; each other goes on in a branch of its own.*\n\n{others}")


def export_folder() -> Path:
    """Where the app saves what a person asks it to (ctrl+e, the palette's screenshot): the documents
    folder, not the current directory (wherever the app was started from); platformdirs honours
    XDG_DOCUMENTS_DIR and user-dirs.dirs. The caller makes it if missing."""
    return platformdirs.user_documents_path() / "pagedchat"


class ChatPane(TabPane):
    """The backend posts the end of each reply (`EngineOutput`) and errors (`EngineError`) here,
    never to the App; the reply in progress is taken from the backend (`catch_up`)."""

    DEFAULT_CSS = """
    ChatPane {
        padding: 0;
    }
    ChatPane > #transcript {
        height: 1fr;
        padding: 0 1;
        scrollbar-size-vertical: 1;
    }
    ChatPane > #turn-info {
        height: auto;
        padding: 0 1;
        color: $text-muted;
    }
    ChatPane .new-chat, ChatPane .carry-on {
        margin: 0 0 1 2;
    }
    ChatPane .context-full {
        height: auto;
    }
    """

    def __init__(self, conversation: Conversation, title: str, colour: int,
                 chat: ChatBackend | None = None, record: ChatRecord | None = None, label: Content | None = None) -> None:
        super().__init__(label or title, id=conversation.key)
        self.conversation = conversation
        self.record = record  # where the conversation is saved; None with --no-history
        self.title = title
        self.colour = colour
        self.chat = chat
        self.max_len = chat.max_len if chat else None
        self.replying = False  # a reply is on its way (waiting, prefilling, generating, preempted)
        self.full = False  # the conversation reached the model's context
        self._reply: ChatMessage | None = None  # the reply in progress
        self._text = ""  # the reply so far, as the engine reported it
        self._shown = ""  # the part of it drawn

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="transcript"):
            for turn in self.conversation.turns:
                yield ChatMessage(turn.role, turn.text)
        yield Static(id="turn-info")
        yield MessageBox()

    def on_mount(self) -> None:
        self.query_one("#transcript").anchor()

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        # TabPane activates its tab when something inside it gets focus. This pane's queue can be
        # long with streamed tokens, so the focus may arrive after the user switched tabs: it must
        # not switch back. Only the pane on show (the active one) may claim its tab. Handlers run
        # from the subclass up, and prevent_default skips those of the base classes (TabPane's).
        if not self.display:
            event.prevent_default()

    # -- turns -------------------------------------------------------------------------------------

    def on_message_box_submitted(self, event: MessageBox.Submitted) -> None:
        event.stop()
        if self.send(event.text):
            event.box.clear()

    def send(self, text: str) -> bool:
        """Send a user message; False (and a notice why) if it cannot go now."""
        text = text.strip()
        if not text:
            self.notify("The message is empty: nothing to send.", severity="warning")
        elif self.chat is None:
            self.notify("The model is still loading.", severity="warning")
        elif self.replying:
            self.notify("A reply is on its way: wait for it, or press escape to stop it.", severity="warning")
        else:
            try:
                send = self.conversation.send(text, self.max_len, self.chat.limit)
            except MessageTooLong as exc:  # the chat is not full: the message stays in the box to shorten
                self.notify(f"Not sent: {exc}.", severity="error")
                return False
            except ContextFull as exc:
                self._context_full(str(exc))
                return False
            if self.record:
                self.record.user(text)
            self._transcript.mount(ChatMessage("user", text))
            self._start_reply(send)
            return True
        return False

    def stop(self) -> None:
        if self.replying and self.chat is not None:
            self.chat.abort(self.conversation.request_id)

    def regenerate(self) -> None:
        if self.replying:
            self.notify("Stop the reply first (escape), then regenerate.", severity="warning")
            return
        if self.chat is None or self.conversation.last_reply is None:
            self.notify("There is no reply to regenerate.", severity="warning")
            return
        old, send = self.conversation.regenerate()
        self._close_request(old)
        if self.record:
            self.record.drop(1)
        replies = self._transcript.query(ChatMessage).filter(".-assistant")
        if replies:
            replies.last().remove()
        self._start_reply(send)

    @property
    def shown_text(self) -> str:
        """The reply in progress as drawn on screen (`draw`)."""
        return self._shown

    @property
    def reply_text(self) -> str:
        """The reply in progress, as far as the engine has reported it."""
        self.catch_up()
        return self._text

    def catch_up(self) -> None:
        """Take the reply in progress as far as the engine has got (the app calls this on its tick)."""
        if not self.replying or self.chat is None:
            return
        output = self.chat.progress(self.conversation.request_id)
        if output is not None and output.outputs[0].text != self._text:
            self._text = output.outputs[0].text
            if self.record:
                self.record.reply_progress(self._text)

    def copy_reply(self) -> None:
        if (reply := self.conversation.last_reply) is None:
            self.notify("No reply to copy yet.", severity="warning")
            return
        self.app.copy_to_clipboard(reply.text)
        self.notify(f"Copied {len(reply.text)} characters.")

    def export(self) -> None:
        """Save the conversation as Markdown in the export folder."""
        if not self.conversation.turns:
            self.notify("Nothing to export yet.", severity="warning")
            return
        path = export_folder() / f"{self.id}-{time.strftime('%Y%m%d-%H%M%S')}.md"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.conversation.markdown(self.title), encoding="utf-8")
        except OSError as exc:
            self.notify(f"Could not export the chat to {path}: {one_line(exc)}", severity="error")
            return
        self.notify(f"Saved the chat to {path}")

    def edit_settings(self) -> None:
        settings = TabSettings(self.conversation.system_prompt, self.conversation.params)
        self.app.push_screen(SettingsScreen(self.title, settings), self.apply_settings)

    def apply_settings(self, settings: TabSettings | None) -> None:
        if settings is None:
            return
        self.conversation.params = settings.params
        if settings.system_prompt != self.conversation.system_prompt:
            if self.replying:
                self.notify("The system prompt changes after this reply: stop it or wait.", severity="warning")
            else:
                # The system prompt is the first thing the model read: the next turn resends everything.
                self._close_request(self.conversation.set_system_prompt(settings.system_prompt))
        if self.record:
            self.record.settings(self.conversation)

    def close(self) -> str:
        """The tab is closing: the blocks only this conversation held go back to the pool. Returns the
        text to keep as its draft: the message box's, or else a message whose reply is cut short."""
        draft = self.query_one(MessageBox).text
        if self.replying:
            self._end_reply()
            draft = draft or self.conversation.turns[-1].text
            if self.record:
                self.record.drop(2)  # the message and its reply
        self._close_request(self.conversation.close())
        if self.record:
            self.record.close()
        return draft

    def start_forked_reply(self, partial_text: str) -> None:
        """This pane is a fork of a conversation whose reply is in progress: it streams its own."""
        self._begin_reply(partial_text)

    def _start_reply(self, send: Send) -> None:
        assert self.chat is not None
        self.chat.reply(send, self.conversation.params, WidgetSink(self))
        self._begin_reply("")

    def _begin_reply(self, text: str) -> None:
        # The last turn's numbers would read as this one's while it streams.
        self.query_one("#turn-info", Static).update("this turn: replying… (escape stops it)")
        self.replying = True
        self._text = self._shown = text
        self._reply = ChatMessage("assistant", text)
        self._transcript.mount(self._reply)
        if self.record:
            self.record.reply_started(text)

    # -- what the engine thread posts --------------------------------------------------------------

    async def on_engine_output(self, message: EngineOutput) -> None:
        message.stop()
        output = message.output
        if not self.replying or output.request_id != self.conversation.request_id:
            return  # a stale report (an earlier request of this tab, or the one a fork starts with)
        completion = output.outputs[0]
        self._text = completion.text
        await self.draw()
        await self._finish(output, completion)

    async def on_engine_error(self, message: EngineError) -> None:
        message.stop()
        if self.replying and message.request_id == self.conversation.request_id:
            await self._fail(message.error)

    async def draw(self) -> None:
        """Bring the reply on screen up to what the tab took from the engine (`catch_up`). The app
        calls this on its tick, at most once a frame and for the tab on show only, rather than each
        token: every redraw costs a layout of the screen, and the UI thread shares the GIL with the
        engine, so each one slows generation. Appended here rather than through a `MarkdownStream`,
        whose own task would update the reply a moment after the tick: a second frame."""
        if self._reply is None or self._text == self._shown:
            return
        text = self._text
        if text.startswith(self._shown):
            await self._reply.append(visible(text[len(self._shown):]))
        else:  # a stop string cut text already shown
            await self._reply.update(visible(text))
        self._shown = text

    async def _finish(self, output: RequestOutput, completion: CompletionOutput) -> None:
        if completion.finish_reason == "error":
            await self._fail(completion.error or "the engine failed this request")
            return
        self._end_reply()
        self.conversation.add_reply(completion.text, completion.token_ids)
        if self.record:
            self.record.reply_done(completion.text)
        prompt, reused = len(output.prompt_token_ids), output.num_cached_tokens
        note = FINISH_NOTES.get(completion.finish_reason, "")
        # The backend's count: a server applies the chat template itself.
        if self.max_len is not None and prompt + len(completion.token_ids) >= self.max_len - 1:
            note = "context full"
            self._context_full(f"the conversation has reached the {self.max_len} tokens {self.chat.limit} holds")
        if len(output.outputs) > 1:
            await self._transcript.mount(ChatMessage("notice", samples_note(output.outputs)))
        # It wraps where the chat is narrow (a layout once a turn).
        self.query_one("#turn-info", Static).update(
            f"last turn: prompt {prompt} tok, {reused} from KV blocks, {prompt - reused} computed · "
            f"reply {len(completion.token_ids)} tok" + (f" · {note}" if note else ""))

    async def _fail(self, error: str) -> None:
        reply = self._reply
        self._end_reply()
        if not self._text and reply is not None:
            await reply.remove()
        self._close_request(self.conversation.fail_turn())
        if self.record:
            self.record.drop(2)  # the message and its reply
        await self._transcript.mount(ChatMessage("error", f"**Error:** {error}"))

    def _end_reply(self) -> None:
        self._reply = None
        self.replying = False

    def _context_full(self, reason: str) -> None:
        self.full = True
        if not self.conversation.num_tokens:  # a server's session: the tokens are counted there, not here
            self._transcript.mount(ChatMessage("notice", f"**Context full:** {reason}. "
                                                         "Start a new chat to go on (ctrl+n)."))
            self._transcript.mount(Button("New chat", classes="new-chat", variant="primary"))
            return
        self._transcript.mount(ChatMessage(
            "notice", f"**Context full:** {reason}. Go on in a new tab that keeps the system prompt and the latest "
                      "turns (this one stays as it is), or start a new chat (ctrl+n)."))
        self._transcript.mount(Horizontal(Button("Continue in a new tab", classes="carry-on", variant="primary"),
                                          Button("New chat", classes="new-chat"), classes="context-full"))

    async def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.has_class("new-chat"):
            event.stop()
            await self.run_action("app.new_chat")
        elif event.button.has_class("carry-on"):
            event.stop()
            await self.app.tabs.carry_on(self)

    def _close_request(self, request_id: str | None) -> None:
        if request_id is not None and self.chat is not None:
            self.chat.close(request_id)

    @property
    def _transcript(self) -> VerticalScroll:
        return self.query_one("#transcript", VerticalScroll)
