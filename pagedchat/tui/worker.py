"""The engine thread as the app uses it: the end of each reply and every error arrive as Textual messages.

A reply in progress is polled (`progress`), since the UI draws at most a few times a second and a
message per token costs the UI thread (and so the engine: they share the GIL) for nothing. The messages
go to the widget that asked for the request, by `post_message` on that widget: posting to the widget
(not the App) is safe at shutdown, and it never blocks the engine thread the way `call_from_thread` would.
"""

from dataclasses import dataclass

from textual.message import Message
from textual.message_pump import MessagePump

from pagedchat.engine.engine_thread import EngineThread
from pagedchat.engine.outputs import RequestOutput
from pagedchat.engine.params import SamplingParams


class EngineOutput(Message):
    """A request finished: its whole reply, and why it ended."""

    def __init__(self, output: RequestOutput) -> None:
        super().__init__()
        self.output = output


class EngineError(Message):
    """A command or a step failed for this request; the other requests go on."""

    def __init__(self, request_id: str, error: str) -> None:
        super().__init__()
        self.request_id = request_id
        self.error = error


@dataclass(frozen=True, slots=True)
class WidgetSink:
    """A request's sink that posts its end and its errors to a widget."""

    widget: MessagePump

    def output(self, output: RequestOutput) -> None:
        if output.finished:
            self.widget.post_message(EngineOutput(output))

    def error(self, request_id: str, error: str) -> None:
        self.widget.post_message(EngineError(request_id, error))


class EngineWorker(EngineThread):
    """The engine thread, with widgets for sinks. Every public method is called from the UI thread."""

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, sink: MessagePump) -> None:
        """A new conversation: kept resident in the engine between turns (keep=True)."""
        super().add(request_id, prompt, params, WidgetSink(sink))

    def continue_(self, request_id: str, new_ids: list[int], params: SamplingParams, sink: MessagePump) -> None:
        super().continue_(request_id, new_ids, params, WidgetSink(sink))

    def fork(self, source_id: str, request_id: str, sink: MessagePump) -> None:
        super().fork(source_id, request_id, WidgetSink(sink))
