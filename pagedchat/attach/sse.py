"""Server-sent events off a streamed httpx response: the part of the format OpenAI-style servers use."""

from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, slots=True)
class ServerSent:
    event: str  # "message" unless the server named it
    id: str | None
    data: str


async def server_sent(response: httpx.Response) -> AsyncIterator[ServerSent]:
    event, ident, data = "message", None, []
    async for line in response.aiter_lines():
        if not line:  # a blank line ends an event
            if data:
                yield ServerSent(event, ident, "\n".join(data))
            event, ident, data = "message", None, []
            continue
        if line.startswith(":"):  # a comment: servers send them to keep the connection up
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id":
            ident = value
