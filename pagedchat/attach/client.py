"""An OpenAI-compatible server's API as the app needs it: vLLM's or `pagedchat serve`'s (which adds the KV
snapshot and its block events). Async, on httpx: it runs in Textual's event loop."""

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx

from pagedchat.attach.metrics import ServerMetrics, parse_metrics
from pagedchat.attach.sse import server_sent
from pagedchat.engine.api.errors import one_line
from pagedchat.engine.api.params import SamplingParams
from pagedchat.engine.api.snapshot import BlockEvent, KVSnapshot, snapshot_from_json

TIMEOUT = httpx.Timeout(30.0)
# A stream may be silent for long: a long prefill, a busy server, a block-event stream with no events.
STREAM_TIMEOUT = httpx.Timeout(30.0, read=None)
SESSION_HEADER = "X-Session-ID"  # vLLM's name; `pagedchat serve` reads it too


class ApiError(Exception):
    """What went wrong with the server, in one line for the user."""


@dataclass(frozen=True, slots=True)
class ServerInfo:
    model: str
    max_model_len: int | None
    kind: str  # "pagedchat" (serves the KV snapshot: the real block grid) | "vllm" (any other server)


@dataclass(frozen=True, slots=True)
class ChatDelta:
    """One streamed chunk of a reply."""

    request_id: str  # the chunk's id: for `pagedchat serve`, the id its snapshot knows the request by
    prompt_token_ids: tuple[int, ...] | None  # the first chunk's: the prompt as the server tokenized it
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    cached_tokens: int | None  # the last (usage) chunk's: prompt tokens served from the prefix cache


class ApiClient:
    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=TIMEOUT)

    async def info(self) -> ServerInfo:
        model = (await self._get_json("/v1/models"))["data"][0]
        with self._transport_errors():
            probe = await self._http.get("/v1/kv/snapshot")
        kind = "pagedchat" if probe.status_code == 200 else "vllm"
        return ServerInfo(model=model["id"], max_model_len=model.get("max_model_len"), kind=kind)

    async def chat(self, messages: list[dict[str, str]], params: SamplingParams,
                   session_id: str | None = None) -> AsyncIterator[ChatDelta]:
        """The reply, chunk by chunk. Closing the iterator early (aclose, or cancelling the task reading
        it) closes the connection, and the server aborts the request."""
        if params.n != 1:
            raise ValueError(f"a chat streams one reply: n must be 1, got {params.n}")
        body = chat_body(messages, params) | ({"session_id": session_id} if session_id else {})
        headers = {SESSION_HEADER: session_id} if session_id else {}
        async with self._stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            async for event in server_sent(response):
                if event.data == "[DONE]":
                    return
                chunk = json.loads(event.data)
                if "error" in chunk:
                    raise ApiError(f"the server at {self.base_url} failed the request: {error_message(chunk)}")
                yield chat_delta(chunk)

    async def detokenize(self, token_ids: list[int] | tuple[int, ...]) -> str:
        return (await self._post_json("/detokenize", {"tokens": list(token_ids)}))["prompt"]

    async def metrics(self) -> ServerMetrics:
        with self._transport_errors():
            response = await self._http.get("/metrics")
        self._check(response)
        return parse_metrics(response.text)

    async def kv_snapshot(self) -> KVSnapshot:
        """`pagedchat serve` only: the pool as its engine sees it."""
        return snapshot_from_json(await self._get_json("/v1/kv/snapshot"))

    async def kv_events(self, since: int | None = None) -> AsyncIterator[BlockEvent | None]:
        """`pagedchat serve` only: its block events after seq `since` (None: from now on), in seq order.
        None is a resync: events were dropped before they were sent, so refetch the snapshot."""
        query = {"since": since} if since is not None else {}
        async with self._stream("GET", "/v1/kv/events", params=query) as response:
            async for event in server_sent(response):
                yield None if event.event == "resync" else BlockEvent(**json.loads(event.data))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _get_json(self, path: str) -> dict:
        with self._transport_errors():
            response = await self._http.get(path)
        self._check(response)
        return response.json()

    async def _post_json(self, path: str, body: dict) -> dict:
        with self._transport_errors():
            response = await self._http.post(path, json=body)
        self._check(response)
        return response.json()

    @contextlib.asynccontextmanager
    async def _stream(self, method: str, path: str, **kwargs) -> AsyncIterator[httpx.Response]:
        # The with-block's exit closes the response: unread, its connection is dropped, not pooled,
        # which is what tells the server that the client has gone.
        with self._transport_errors():
            async with self._http.stream(method, path, timeout=STREAM_TIMEOUT, **kwargs) as response:
                if response.is_error:
                    await response.aread()
                    self._check(response)
                yield response

    @contextlib.contextmanager
    def _transport_errors(self) -> Iterator[None]:
        try:
            yield
        except httpx.ConnectError as exc:
            raise ApiError(f"nothing answers at {self.base_url}: is the server running?") from exc
        except httpx.TimeoutException as exc:
            raise ApiError(f"the server at {self.base_url} did not answer in time") from exc
        except httpx.TransportError as exc:
            raise ApiError(f"the connection to {self.base_url} failed: {one_line(exc, with_type=True)}") from exc

    def _check(self, response: httpx.Response) -> None:
        if response.status_code == 401:
            asked = "refused the API key" if self.api_key else "wants an API key (--api-key)"
            raise ApiError(f"the server at {self.base_url} {asked} (401)")
        if response.is_error:
            try:
                message = error_message(response.json())
            except ValueError:
                message = response.text
            raise ApiError(f"the server at {self.base_url} answered {response.status_code}: "
                           f"{first_line(message) or response.reason_phrase}")


def chat_body(messages: list[dict[str, str]], params: SamplingParams) -> dict:
    # Every field is sent, defaults included: vLLM fills the ones left out from the model's
    # generation_config.json, which would make the reply differ from the app's settings.
    body = {
        "messages": messages, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
        "temperature": params.temperature, "top_p": params.top_p,
        "top_k": params.top_k,  # 0 is off for both servers
        "seed": params.seed, "min_tokens": params.min_tokens, "stop": list(params.stop_strings),
        "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos,
        "repetition_penalty": params.repetition_penalty, "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
    }
    if params.max_tokens is not None:  # None: as long as the context allows, the servers' default
        body["max_tokens"] = params.max_tokens
    return body


def chat_delta(chunk: dict) -> ChatDelta:
    choice = chunk["choices"][0] if chunk.get("choices") else {}
    details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
    prompt = chunk.get("prompt_token_ids")
    return ChatDelta(
        request_id=chunk["id"],
        prompt_token_ids=tuple(prompt) if prompt is not None else None,
        text=(choice.get("delta") or {}).get("content") or "",
        token_ids=tuple(choice.get("token_ids") or ()),
        finish_reason=choice.get("finish_reason"),
        cached_tokens=details.get("cached_tokens"),
    )


def error_message(body) -> str:
    # OpenAI's {"error": {"message": ...}}; vLLM's auth middleware answers {"error": "Unauthorized"};
    # FastAPI's own errors (a 404 for a path it lacks) {"detail": ...}.
    if isinstance(body, dict):
        error = body.get("error", body.get("detail"))
        if isinstance(error, dict):
            return str(error.get("message", error))
        if error is not None:
            return str(error)
    return str(body)


def first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""
