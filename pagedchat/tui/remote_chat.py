"""The chat tabs of a server the app attached to (`pagedchat --attach URL`): each turn streams from its chat API.

The server applies the chat template and counts the tokens: a turn sends the whole message list, and
the ids come back with the reply (`return_token_ids`). The streams run as tasks on the UI's event
loop; stopping a reply cancels its task, which closes the HTTP stream, and the server aborts it.
"""

import asyncio
import logging
import uuid
from collections.abc import Sequence

from pagedchat.attach.client import ApiClient, ApiError
from pagedchat.engine.runtime.engine_thread import Sink
from pagedchat.engine.api.errors import one_line
from pagedchat.engine.api.outputs import CompletionOutput, RequestOutput
from pagedchat.engine.api.params import SamplingParams
from pagedchat.engine.chat import RequestKey
from pagedchat.tui.conversation import Send

log = logging.getLogger(__name__)


class MessageSession:
    """A conversation as chat messages; its tokens are the server's business."""

    def __init__(self, system_prompt: str | None) -> None:
        self.messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.token_ids: list[int] = []  # never known here: the server reports them per reply

    def user_turn(self, text: str) -> list[int]:
        self.messages.append({"role": "user", "content": text})
        return []

    def add_reply(self, token_ids: Sequence[int] | None, text: str | None = None) -> None:
        self.messages.append({"role": "assistant", "content": text or ""})


class RemoteChat:
    forks_replies = False  # a fork is a new conversation with the same history, sent at its next turn
    limit = "the model's context"  # as the server reports it

    def __init__(self, client: ApiClient, max_len: int | None) -> None:
        self.client = client
        self.max_len = max_len
        self.server_ids: dict[str, str] = {}  # the server's request id: ours
        self._streams: dict[str, asyncio.Task] = {}
        self._progress: dict[str, RequestOutput] = {}
        self._contexts: dict[str, RequestOutput] = {}  # each request's last output: its prompt and reply ids
        # One server session per conversation (pagedchat serve keeps a session's KV between turns, and
        # starts it anew when the messages no longer continue it: a regenerate, a new system prompt).
        self._session_prefix = f"pagedchat-{uuid.uuid4().hex[:12]}"

    def new_session(self, system_prompt: str | None) -> MessageSession:
        return MessageSession(system_prompt)

    @property
    def contexts(self) -> dict[str, list[int]]:
        """Each request's tokens as the server counted them: its prompt and its reply so far."""
        return {request_id: output.prompt_token_ids + output.outputs[0].token_ids
                for request_id, output in self._contexts.items()}

    def num_tokens(self, request_id: str) -> int:
        output = self._contexts.get(request_id)
        return len(output.prompt_token_ids) + len(output.outputs[0].token_ids) if output else 0

    def reply(self, send: Send, params: SamplingParams, sink: Sink) -> None:
        assert send.request_id not in self._streams, "one turn at a time per conversation"
        task = asyncio.get_running_loop().create_task(self._stream(send, params, sink))
        self._streams[send.request_id] = task
        task.add_done_callback(lambda done: self._ended(send.request_id, done, sink))

    def progress(self, request_id: str) -> RequestOutput | None:
        return self._progress.get(request_id)

    def abort(self, request_id: str) -> None:
        if (task := self._streams.get(request_id)) is not None:
            task.cancel()

    def close(self, request_id: str) -> None:
        self.abort(request_id)
        self._progress.pop(request_id, None)
        self._contexts.pop(request_id, None)
        for server_id in [key for key, ours in self.server_ids.items() if ours == request_id]:
            del self.server_ids[server_id]

    def session_id(self, request_id: str) -> str:
        return f"{self._session_prefix}-{RequestKey.parse(request_id).conversation}"

    def fork(self, source_id: str, twin_id: str, sink: Sink) -> None:
        """Nothing to tell the server: the twin sends its history with its first turn. Until then it counts
        as holding the source's tokens (the panel matches them against the server's blocks)."""
        if source_id in self._contexts:
            self._contexts[twin_id] = self._contexts[source_id]

    async def stop(self) -> None:
        tasks = list(self._streams.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _ended(self, request_id: str, task: asyncio.Task, sink: Sink) -> None:
        if self._streams.get(request_id) is task:
            del self._streams[request_id]
        if task.cancelled():  # stopped before it began: no output came, and none will
            sink.output(RequestOutput(request_id, [], [CompletionOutput(0, finish_reason="abort")], True))

    async def _stream(self, send: Send, params: SamplingParams, sink: Sink) -> None:
        request_id = send.request_id
        completion = CompletionOutput(0)
        output = RequestOutput(request_id, [], [completion], False)
        self._progress[request_id] = output
        try:
            async for delta in self.client.chat(list(send.messages), params,
                                                session_id=self.session_id(request_id)):
                self.server_ids[delta.request_id] = request_id
                if delta.prompt_token_ids is not None:
                    output.prompt_token_ids = list(delta.prompt_token_ids)
                    self._contexts[request_id] = output
                completion.text += delta.text
                completion.token_ids += delta.token_ids
                completion.finish_reason = delta.finish_reason or completion.finish_reason
                if delta.cached_tokens is not None:
                    output.num_cached_tokens = delta.cached_tokens
        except asyncio.CancelledError:
            completion.finish_reason = "abort"
        except ApiError as exc:
            sink.error(request_id, str(exc))
            return
        except Exception as exc:  # a reply the client could not read: that tab's error, the others go on
            log.exception("the stream of %s failed", request_id)
            sink.error(request_id, one_line(exc, with_type=True))
            return
        if completion.finish_reason is None:
            sink.error(request_id, "the server ended the stream before the reply finished")
            return
        output.finished = True
        sink.output(output)
