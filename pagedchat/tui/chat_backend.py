"""What a chat tab asks of whatever writes its replies: the local engine, or a server the app attached to.

The tab holds a `Conversation`; each turn it hands the backend a `Send` (the new tokens for the local
engine, the whole message list for a server, which applies the chat template itself). Outputs and
errors come back through the tab's sink, on whichever thread the backend runs them.
"""

from typing import Protocol

from pagedchat.engine.chat import ChatSession, ChatSessionLike
from pagedchat.engine.runtime.engine_thread import EngineThread, Sink
from pagedchat.engine.api.outputs import RequestOutput
from pagedchat.engine.api.params import SamplingParams
from pagedchat.tui.conversation import Send


class ChatBackend(Protocol):
    """Called on the UI thread."""

    max_len: int | None  # the longest conversation, in tokens, where known
    limit: str  # what sets max_len, as the notices name it: "the model's context", "the KV pool"
    forks_replies: bool  # a fork takes over the reply in progress (else it starts from the last finished turn)

    def new_session(self, system_prompt: str | None) -> ChatSessionLike: ...
    def reply(self, send: Send, params: SamplingParams, sink: Sink) -> None: ...
    def progress(self, request_id: str) -> RequestOutput | None: ...  # the reply in progress, as far as it got
    def abort(self, request_id: str) -> None: ...  # its last output says "abort"
    def close(self, request_id: str) -> None: ...  # the conversation is gone: free what it held
    def fork(self, source_id: str, twin_id: str, sink: Sink) -> None: ...


class LocalChat:
    """The chat tabs of the app's own engine: conversations stay resident between turns."""

    forks_replies = True

    def __init__(self, worker: EngineThread, tokenizer, max_len: int, pool_tokens: int) -> None:
        self.worker = worker
        self.max_len = max_len
        # A pool smaller than the model's context caps the conversations at the pool (engine config).
        self.limit = "the KV pool" if pool_tokens <= max_len else "the model's context"
        self._tokenizer = tokenizer  # the UI thread's own copy (the engine thread has its own)

    def new_session(self, system_prompt: str | None) -> ChatSession:
        return ChatSession(self._tokenizer, system_prompt)

    def reply(self, send: Send, params: SamplingParams, sink: Sink) -> None:
        if send.new_request:
            self.worker.add(send.request_id, send.token_ids, params, sink)
        else:
            self.worker.continue_(send.request_id, send.token_ids, params, sink)

    def progress(self, request_id: str) -> RequestOutput | None:
        return self.worker.progress(request_id)

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)

    def close(self, request_id: str) -> None:
        self.worker.close(request_id)

    def fork(self, source_id: str, twin_id: str, sink: Sink) -> None:
        self.worker.fork(source_id, twin_id, sink)
