"""RemoteChat, the tabs' backend in attach mode, against a fake client: every turn ends in an output or
an error for its tab, whatever the stream does, so a tab never stays 'replying'."""

import asyncio

from support.tui import async_test

from pagedchat import SamplingParams
from pagedchat.attach.client import ChatDelta
from pagedchat.tui.conversation import Send
from pagedchat.tui.remote_chat import RemoteChat


class Sink:
    def __init__(self) -> None:
        self.outputs, self.errors = [], []

    def output(self, output) -> None:
        self.outputs.append(output)

    def error(self, request_id: str, error: str) -> None:
        self.errors.append((request_id, error))


class FakeClient:
    def __init__(self, chat) -> None:
        self.chat = chat


def send(request_id: str = "chat-1.1") -> Send:
    return Send(request_id, [], True, ({"role": "user", "content": "hi"},))


async def until(condition) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


@async_test
async def test_a_stream_that_cannot_be_read_fails_its_tab_with_one_line():
    async def broken(messages, params, session_id=None):
        yield ChatDelta("srv-1", (1, 2), "a", (7,), None, None)
        raise KeyError("id")  # a chunk without the fields a completion chunk has

    chat, sink = RemoteChat(FakeClient(broken), 100), Sink()
    chat.reply(send(), SamplingParams(), sink)
    await until(lambda: sink.errors)
    assert sink.errors == [("chat-1.1", "KeyError: 'id'")] and sink.outputs == []
    assert chat.contexts == {"chat-1.1": [1, 2, 7]}
    chat.reply(send(), SamplingParams(), sink)  # the next turn may go
    await until(lambda: len(sink.errors) == 2)


@async_test
async def test_a_reply_stopped_before_its_stream_began_still_ends():
    async def never_called(messages, params, session_id=None):
        raise AssertionError("the stream should not have started")
        yield

    chat, sink = RemoteChat(FakeClient(never_called), 100), Sink()
    chat.reply(send(), SamplingParams(), sink)
    chat.abort("chat-1.1")  # at once: the task has not run a step yet
    await until(lambda: sink.outputs)
    (output,) = sink.outputs
    assert output.finished and output.finish_reason == "abort" and sink.errors == []


@async_test
async def test_a_stream_is_one_output_with_the_servers_ids_and_a_fork_counts_its_sources_tokens():
    async def reply(messages, params, session_id=None):
        assert session_id.endswith("-chat-1") and messages == [{"role": "user", "content": "hi"}]
        yield ChatDelta("srv-9", (1, 2, 3), "", (), None, None)
        yield ChatDelta("srv-9", None, "he", (4,), None, None)
        yield ChatDelta("srv-9", None, "llo", (5,), "stop", None)
        yield ChatDelta("srv-9", None, "", (), None, 2)  # the usage chunk

    chat, sink = RemoteChat(FakeClient(reply), 100), Sink()
    chat.reply(send(), SamplingParams(), sink)
    await until(lambda: sink.outputs)
    (output,) = sink.outputs
    assert (output.text, output.token_ids, output.prompt_token_ids) == ("hello", [4, 5], [1, 2, 3])
    assert output.finish_reason == "stop" and output.num_cached_tokens == 2
    assert chat.server_ids == {"srv-9": "chat-1.1"}
    chat.fork("chat-1.1", "chat-2.1", sink)
    assert chat.contexts == {"chat-1.1": [1, 2, 3, 4, 5], "chat-2.1": [1, 2, 3, 4, 5]}
    chat.close("chat-1.1")
    assert chat.server_ids == {} and "chat-1.1" not in chat.contexts
