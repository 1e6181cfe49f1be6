"""A chat as the engine sees it: token ids, built message by message with the model's chat template.

Both front ends build on this: the app's tabs (`pagedchat.tui.conversation`) and the server's sessions
(`pagedchat.serve.sessions`). Torch-free: it needs only a tokenizer.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RequestKey:
    """The engine request of a conversation's `run`-th sequence: `<conversation>.<run>` as a string.

    A conversation starts a new sequence (a new run) whenever tokens already sent change: a
    regenerated reply, a new system prompt, a failed turn. The samples of a reply with n > 1 run as
    `<request>#<i>` beside the request itself (sample 0)."""

    conversation: str
    run: int = 1
    sample: int = 0

    def __str__(self) -> str:
        request = f"{self.conversation}.{self.run}"
        return sample_id(request, self.sample) if self.sample else request

    @classmethod
    def parse(cls, request_id: str) -> "RequestKey | None":
        """The key a request id spells, or None for an id no conversation made (an API client's)."""
        request, _, sample = request_id.partition("#")
        conversation, dot, run = request.rpartition(".")
        if not (dot and conversation and run.isdigit() and (sample.isdigit() or not sample)):
            return None
        return cls(conversation, int(run), int(sample or 0))


def sample_id(request_id: str, index: int) -> str:
    """The id of sample `index` (1, 2, ...) of a request with n > 1; sample 0 is the request itself."""
    return f"{request_id}#{index}"


def chat_prompt(tokenizer, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """One conversation's prompt in one go, for a request that keeps no session (`LLM.chat`, a server
    request outside a session, `/tokenize`)."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


class ChatSession:
    """A conversation as token ids.

    The model's own reply tokens are kept exactly as generated (EOS included), never re-tokenized from
    text; a new message adds only what the chat template renders for it, found by rendering the
    conversation with and without it. The template's default system prompt is thus rendered once.
    """

    def __init__(self, tokenizer, system_prompt: str | None = None):
        self.tokenizer = tokenizer
        self.messages: list[dict[str, str]] = []
        if system_prompt:
            self.messages.append({"role": "system", "content": system_prompt})
        self.token_ids: list[int] = []
        self._rendered = ""  # the template's text up to the last generation prompt
        self._reply_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def user_turn(self, text: str) -> list[int]:
        """Add a user message; return the token ids to send (the whole prompt on the first turn)."""
        before = self._render(add_generation_prompt=False) if self.token_ids else ""
        self.messages.append({"role": "user", "content": text})
        rendered = self._render(add_generation_prompt=True)
        if not rendered.startswith(before):
            raise ValueError("this chat template rewrites earlier turns; it cannot be continued incrementally")
        glue = self._unfinished_reply_tail(before) if self._reply_ids is not None else ""
        new_ids = self._encode(glue + rendered[len(before) :])
        self._rendered = rendered
        self._reply_ids = None
        self.token_ids += new_ids
        return new_ids

    def add_reply(self, token_ids: Sequence[int] | None, text: str | None = None) -> None:
        """Record the model's reply: its tokens as generated, its text for the template. A reply known
        only by its text (saved without its tokens, or sent back by an API client) is tokenized here,
        the one place that does."""
        if token_ids is None:
            token_ids = self._encode(text or "")
        if text is None:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        self.token_ids += token_ids
        self.messages.append({"role": "assistant", "content": text})
        self._reply_ids = list(token_ids)

    def _unfinished_reply_tail(self, rendered_with_reply: str) -> str:
        """What the template closes a reply with beyond what the model generated (e.g. the newline
        after <|im_end|>, or the whole end-of-turn marker of a reply that was stopped)."""
        reply = rendered_with_reply[len(self._rendered) :]
        generated = self.tokenizer.decode(self._reply_ids, skip_special_tokens=False)
        return reply[len(generated) :] if reply.startswith(generated) else ""

    def _render(self, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            self.messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


class ChatSessionLike(Protocol):
    """A `ChatSession`, or what stands in for one where a server keeps the tokens (the app attached)."""

    token_ids: list[int]
    messages: list[dict[str, str]]  # the conversation as chat messages, the system prompt first

    def user_turn(self, text: str) -> list[int]: ...
    def add_reply(self, token_ids: Sequence[int] | None, text: str | None = None) -> None: ...


def replay(session: ChatSessionLike, turns: Iterable[tuple[str, str, Sequence[int] | None]]) -> ChatSessionLike:
    """Feed a fresh session a conversation's (role, text, reply token ids or None) turns, in order."""
    for role, text, token_ids in turns:
        if role == "user":
            session.user_turn(text)
        else:
            session.add_reply(token_ids, text)
    return session
