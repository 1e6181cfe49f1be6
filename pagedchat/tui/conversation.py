"""A chat tab's conversation, apart from any widget: its turns, its ChatSession and its engine request.

A conversation stays resident in the engine between turns: the first turn adds a request with
`keep=True` and sends the whole prompt; later turns send only the new message's tokens with
`continue_request`. Anything that changes tokens already sent (regenerating the last reply, a new
system prompt, a failed turn) rebuilds the session by replaying the turns, closes the engine request,
and the next turn starts a new request with the whole sequence, which the prefix cache mostly serves.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

from pagedchat.engine.api.params import SamplingParams
from pagedchat.engine.chat import ChatSessionLike, RequestKey, replay

DEFAULT_PARAMS = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=512, frequency_penalty=0.5)  # bench/loops.py


class ContextFull(Exception):
    """The message does not fit in what is left of the model's context."""


class MessageTooLong(ContextFull):
    """The message would not fit the model's context even as the first message of a new chat."""


@dataclass(frozen=True)
class Turn:
    role: str  # "user" | "assistant"
    text: str
    token_ids: tuple[int, ...] | None = None  # the model's own reply tokens; None: unknown (a saved reply)
    system_prompt: str | None = None  # the one in force when this turn was sent or generated


@dataclass(frozen=True)
class Send:
    """What to tell the backend for a user turn: the local engine takes tokens, a server messages."""

    request_id: str
    token_ids: list[int]
    new_request: bool  # add_request with the whole sequence, else continue_request with the suffix
    messages: tuple[dict[str, str], ...]  # the whole conversation up to this turn


class Conversation:
    def __init__(self, new_session: Callable[[str | None], ChatSessionLike], key: str,
                 system_prompt: str | None = None, params: SamplingParams = DEFAULT_PARAMS) -> None:
        self.key = key
        self.system_prompt = system_prompt
        self.params = params
        self.turns: list[Turn] = []
        self._request: RequestKey | None = None  # the engine request that holds this conversation
        self._runs = 0  # this conversation's engine requests so far
        self._new_session = new_session
        self._session = new_session(system_prompt)

    @property
    def request_id(self) -> str | None:
        return str(self._request) if self._request else None

    @property
    def num_tokens(self) -> int:
        return len(self._session.token_ids)

    @property
    def last_reply(self) -> Turn | None:
        return self.turns[-1] if self.turns and self.turns[-1].role == "assistant" else None

    def send(self, text: str, max_len: int | None = None, limit: str = "the model's context") -> Send:
        """Add the user's message; raise ContextFull, or MessageTooLong if a new chat would not take it
        either, changing nothing. `limit`: what sets `max_len`, for the message."""
        new_ids = self._session.user_turn(text)
        if max_len is not None and self.num_tokens >= max_len:
            held = self.num_tokens - len(new_ids)
            # on the first turn new_ids is the whole prompt: what a new chat would need
            alone = len(new_ids) if not self.turns else len(self._new_session(self.system_prompt).user_turn(text))
            self._replay(self.turns)  # user_turn changed the session: undo it
            if alone >= max_len:
                raise MessageTooLong(f"the message is {len(text):,} characters, {alone:,} tokens with the chat "
                                     f"template, and {limit} holds {max_len:,}: shorten it")
            raise ContextFull(f"the conversation has {held} of the {max_len} tokens {limit} holds; "
                              f"this message needs {len(new_ids)} more")
        self.turns.append(Turn("user", text, system_prompt=self.system_prompt))
        if self._request is None:
            return self._new_request()
        return Send(self.request_id, new_ids, False, self._messages())

    def add_reply(self, text: str, token_ids: list[int]) -> None:
        self._session.add_reply(list(token_ids), text)
        self.turns.append(Turn("assistant", text, tuple(token_ids), self.system_prompt))

    def regenerate(self) -> tuple[str | None, Send]:
        """Drop the last reply and resend the turns before it: (request to close, what to send)."""
        if self.last_reply is None:
            raise ValueError("there is no reply to regenerate")
        old = self._drop(self.turns[:-1])
        return old, self._new_request()

    def fail_turn(self) -> str | None:
        """The last user message failed: forget it. Returns the request to close."""
        keep = self.turns[:-1] if self.turns and self.turns[-1].role == "user" else self.turns
        return self._drop(keep)

    def close(self) -> str | None:
        """The tab closes: returns the request to close. The turns stay (but a message still waiting for
        its reply): reopened, the next turn sends them all."""
        return self.fail_turn()

    def set_system_prompt(self, prompt: str | None) -> str | None:
        """A new system prompt changes the first tokens: returns the request to close, if any."""
        self.system_prompt = prompt
        return self._drop(self.turns)

    def restore(self, turns: list[Turn]) -> None:
        """Start from saved turns. Nothing of them is in the engine: the next turn sends it all.
        The history keeps one system prompt per chat: every saved turn is taken to have run under it."""
        self._replay([replace(turn, system_prompt=self.system_prompt) for turn in turns])

    def markdown(self, title: str) -> str:
        """The conversation as a Markdown document, for export: the system prompt each turn ran under
        is shown before the first turn that ran under it (none before turns under the model's default)."""
        parts, prompt = [f"# {title}"], None
        for turn in self.turns:
            if turn.system_prompt != prompt:
                prompt = turn.system_prompt
                parts.append(f"*System:* {prompt}" if prompt else "*System:* none (the model's default)")
            parts.append(f"## {turn.role.capitalize()}\n\n{turn.text}")
        return "\n\n".join(parts) + "\n"

    def fork(self, key: str) -> "Conversation":
        """A copy with the same history; its request is forked from this one's (shared blocks)."""
        twin = self.branch(key, self.turns)
        if self._request is not None:
            twin._request, twin._runs = RequestKey(key), 1
        return twin

    def branch(self, key: str, turns: list[Turn]) -> "Conversation":
        """A new conversation under this one's system prompt and settings, holding `turns` (this one's
        first turns: the history before a message to edit). Nothing of it is in the engine: its first
        turn sends it all, and the prefix cache shares the full blocks this one's request holds."""
        twin = Conversation(self._new_session, key, self.system_prompt, self.params)
        twin._replay(turns)
        return twin

    def carry_on(self, key: str, budget: int, message: str = "") -> tuple["Conversation", int]:
        """A branch to go on from this conversation once it is full: its system prompt and the latest
        turns (from a user message on) that take at most `budget` tokens with `message` to follow.
        Returns it and the tokens it begins with as this one does: all that the prefix cache can serve
        it, since every token after them sits at a new position."""
        twin = self.branch(key, [])
        for start in reversed([i for i, turn in enumerate(self.turns) if turn.role == "user"]):
            longer = self.branch(key, self.turns[start:])
            if longer._size_with(message) > budget:
                break
            twin = longer
        old, new = self._session.token_ids, twin._session.token_ids
        shared = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        return twin, shared

    def _size_with(self, message: str) -> int:
        """Its tokens with `message` sent next."""
        if not message:
            return self.num_tokens
        probe = self.branch(self.key, self.turns)
        probe._session.user_turn(message)
        return probe.num_tokens

    def _new_request(self) -> Send:
        """The whole sequence as a new engine request."""
        self._runs += 1
        self._request = RequestKey(self.key, self._runs)
        return Send(self.request_id, list(self._session.token_ids), True, self._messages())

    def _messages(self) -> tuple[dict[str, str], ...]:
        return tuple(dict(message) for message in self._session.messages)

    def _drop(self, turns: list[Turn]) -> str | None:
        old, self._request = self.request_id, None
        self._replay(turns)
        return old

    def _replay(self, turns: list[Turn]) -> None:
        self._session = replay(self._new_session(self.system_prompt),
                               ((turn.role, turn.text, turn.token_ids) for turn in turns))
        self.turns = list(turns)
