"""The chat tabs of a server the app attached to (`pagedchat --attach URL`): each turn streams from its chat API.

The server applies the chat template and counts the tokens: a turn sends the whole message list, and
the ids come back with the reply (`return_token_ids`). The streams run as tasks on the UI's event
loop; stopping a reply cancels its task, which closes the HTTP stream, and the server aborts it.
"""

import asyncio
import uuid

from pagedchat.attach.client import ApiClient, ApiError
from pagedchat.engine.engine_thread import Sink
from pagedchat.engine.outputs import CompletionOutput, RequestOutput
from pagedchat.engine.params import SamplingParams
from pagedchat.tui.conversation import Send


class MessageSession:
    """A conversation as chat messages; its tokens are the server's business."""

    def __init__(self, system_prompt: str | None) -> None:
        self.messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.token_ids: list[int] = []  # never known here: the server reports them per reply

    def user_turn(self, text: str) -> list[int]:
        self.messages.append({"role": "user", "content": text})
        return []

    def add_reply(self, token_ids: list[int], text: str | None = None) -> None:
        self.messages.append({"role": "assistant", "content": text or ""})


class RemoteChat:
    forks_replies = False  # a fork is a new conversation with the same history, sent at its next turn

    def __init__(self, client: ApiClient, max_len: int | None) -> None:
        self.client = client
        self.max_len = max_len
        self.contexts: dict[str, list[int]] = {}  # our request id: its prompt and reply ids as the server sent them
        self.server_ids: dict[str, str] = {}  # the server's request id: ours
        self._streams: dict[str, asyncio.Task] = {}
        self._progress: dict[str, RequestOutput] = {}
        # One server session per request of ours (pagedchat serve keeps a session's KV between turns).
        self._session_prefix = f"pagedchat-{uuid.uuid4().hex[:12]}"

    def new_session(self, system_prompt: str | None) -> MessageSession:
        return MessageSession(system_prompt)

    def reply(self, send: Send, params: SamplingParams, sink: Sink) -> None:
        assert send.request_id not in self._streams, "one turn at a time per conversation"
        self._streams[send.request_id] = asyncio.get_running_loop().create_task(self._stream(send, params, sink))

    def progress(self, request_id: str) -> RequestOutput | None:
        return self._progress.get(request_id)

    def abort(self, request_id: str) -> None:
        if (task := self._streams.get(request_id)) is not None:
            task.cancel()

    def close(self, request_id: str) -> None:
        self.abort(request_id)
        self._progress.pop(request_id, None)
        self.contexts.pop(request_id, None)
        for server_id in [key for key, ours in self.server_ids.items() if ours == request_id]:
            del self.server_ids[server_id]

    def session_id(self, request_id: str) -> str:
        return f"{self._session_prefix}-{request_id}"

    def fork(self, source_id: str, twin_id: str, sink: Sink) -> None:
        """Nothing to tell the server: the twin sends its history with its first turn."""

    def stop(self) -> None:
        for task in self._streams.values():
            task.cancel()

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
                completion.text += delta.text
                completion.token_ids += delta.token_ids
                completion.finish_reason = delta.finish_reason or completion.finish_reason
                if delta.cached_tokens is not None:
                    output.num_cached_tokens = delta.cached_tokens
                self.contexts[request_id] = output.prompt_token_ids + completion.token_ids
        except asyncio.CancelledError:
            completion.finish_reason = "abort"
        except ApiError as exc:
            sink.error(request_id, str(exc))
            return
        finally:
            del self._streams[request_id]
        if completion.finish_reason is None:
            sink.error(request_id, "the server ended the stream before the reply finished")
            return
        output.finished = True
        sink.output(output)
