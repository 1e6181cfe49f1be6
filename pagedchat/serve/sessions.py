"""Sessions: a client's conversation kept in the engine between requests, so a turn computes only its
new message.

A request continues its session when its messages are the session's so far (the assistant ones as
the server returned them) plus new user messages, which go through the ChatSession as in the app: the
model's reply tokens are never re-tokenized. Any other prompt closes the old request and starts anew
(the prefix cache serves what it still holds). Sessions close when idle too long or beyond the cap,
least recently used first; a request with n > 1 never opens one.
"""

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedchat.engine.api.outputs import RequestOutput
from pagedchat.engine.chat import ChatSession, replay


@dataclass
class Session:
    request_id: str
    chat: ChatSession
    messages: list[tuple[str, str]]  # (role, content) as the client will send them back
    busy: bool = True
    used_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Turn:
    request_id: str
    prompt: list[int]  # what to send: the whole conversation, or (continued) the new messages only
    continued: bool
    context_ids: list[int]  # the conversation's tokens before the reply (its whole prompt)
    finish: Callable[[RequestOutput], None]
    abandon: Callable[[], None]


class Sessions:
    def __init__(self, tokenizer, close: Callable[[str], None], idle_s: float, cap: int) -> None:
        self._tokenizer = tokenizer
        self._close_request = close
        self._idle_s = idle_s
        self._cap = cap
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._sessions)

    def turn(self, key: str | None, messages, n: int) -> Turn | None:
        """The turn of session `key` these messages make, or None for a request outside any session."""
        if key is None or n > 1:
            return None
        self.expire()
        said = [(m.role, m.text()) for m in messages]
        session = self._sessions.get(key)
        if session is not None and not session.busy and said[: len(session.messages)] == session.messages:
            new = said[len(session.messages):]
            if new and all(role == "user" for role, _ in new):
                prompt = [token for _, text in new for token in session.chat.user_turn(text)]
                session.messages, session.busy = said, True
                self._sessions.move_to_end(key)
                return self._turn(key, session, prompt, continued=True)
        if session is not None:
            self.close(key)
        chat = self._replay(said)
        if chat is None:
            return None
        session = self._sessions[key] = Session(f"chatcmpl-{uuid.uuid4().hex}", chat, said)
        self._make_room()
        return self._turn(key, session, list(chat.token_ids), continued=False)

    def close(self, key: str) -> None:
        session = self._sessions.pop(key, None)
        if session is not None:
            self._close_request(session.request_id)

    def _turn(self, key: str, session: Session, prompt: list[int], continued: bool) -> Turn:
        def finish(output: RequestOutput) -> None:
            if output.finish_reason in ("stop", "length") and self._sessions.get(key) is session:
                session.chat.add_reply(output.token_ids, output.text)
                session.messages.append(("assistant", output.text))
                session.busy, session.used_at = False, time.monotonic()
            else:
                self.close(key)

        def abandon() -> None:  # the client left, or the engine failed it
            if self._sessions.get(key) is session:
                self.close(key)

        return Turn(session.request_id, prompt, continued, list(session.chat.token_ids), finish, abandon)

    def _replay(self, said: list[tuple[str, str]]) -> ChatSession | None:
        """A ChatSession holding these messages, or None if they are not a conversation it can hold
        (it takes a system prompt first, then turns, and the last message must be the user's)."""
        system = said[0][1] if said and said[0][0] in ("system", "developer") else None
        turns = said[1:] if system is not None else said
        if not turns or turns[-1][0] != "user" or any(role not in ("user", "assistant") for role, _ in turns):
            return None
        # The client sends replies back as text: their tokens were the session's, and it is gone.
        return replay(ChatSession(self._tokenizer, system), ((role, text, None) for role, text in turns))

    def expire(self) -> None:
        """Close the sessions idle longer than the limit."""
        now = time.monotonic()
        for key, session in list(self._sessions.items()):
            if not session.busy and now - session.used_at > self._idle_s:
                self.close(key)

    def _make_room(self) -> None:
        while len(self._sessions) > self._cap:
            idle = next((key for key, s in self._sessions.items() if not s.busy), None)
            if idle is None:
                return
            self.close(idle)
