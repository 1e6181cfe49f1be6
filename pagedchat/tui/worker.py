"""The engine thread's news as the app takes it: the end of each reply and every error, as Textual messages.

A reply in progress is polled (`progress`), since the UI draws at most a few times a second and a
message per token costs the UI thread (and so the engine: they share the GIL) for nothing. The messages
go to the widget that asked for the request, by `post_message` on that widget: posting to the widget
(not the App) is safe at shutdown, and it never blocks the engine thread the way `call_from_thread` would.
"""

from dataclasses import dataclass

from textual.message import Message
from textual.message_pump import MessagePump

from pagedchat.engine.api.outputs import RequestOutput


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
