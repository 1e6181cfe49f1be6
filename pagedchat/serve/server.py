"""The HTTP endpoints: OpenAI's and vLLM's names and JSON shapes, over one engine thread."""

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from pagedchat.engine.api.outputs import RequestOutput
from pagedchat.engine.api.snapshot import snapshot_to_json
from pagedchat.engine.chat import chat_prompt
from pagedchat.serve import metrics
from pagedchat.serve.async_engine import AsyncEngine, EngineFailure
from pagedchat.serve.protocol import ApiError, ChatCompletion, Detokenize, TextCompletion, Tokenize
from pagedchat.serve.sessions import Sessions

log = logging.getLogger(__name__)

EVENTS_POLL_S = 0.05


@dataclass
class Served:
    """What the endpoints need once the model is loaded."""

    engine: AsyncEngine
    tokenizer: object  # the event loop's own instance: fast tokenizers are not thread-safe
    model_name: str
    max_model_len: int  # the longest prompt + reply, the pool included
    counters: metrics.Counters = field(default_factory=metrics.Counters)
    sessions: Sessions | None = None


@dataclass
class ServerState:
    served: Served | None = None  # None while the model loads
    stopped: bool = False
    failure: BaseException | None = None  # why the model did not load
    loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs

    def ready(self) -> Served:
        if self.served is None or self.stopped:
            raise ApiError(503, "the model is loading" if not self.stopped else "the engine has stopped")
        return self.served

    def stop(self) -> None:
        """The server is going: requests get 503 from now on, and the ones in flight end at once."""
        self.stopped = True
        if self.served is not None:
            self.served.engine.stop_all()


def build_app(state: ServerState, api_key: str | None = None) -> FastAPI:
    async def authorize(request: Request) -> None:  # async: a plain def would run in a worker thread
        if api_key and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise ApiError(401, "invalid or missing API key")

    # A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware hides a client's disconnect.
    app = FastAPI(title="pagedchat", docs_url=None, redoc_url=None)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(ApiError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"))
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        if where is None and first.get("loc", ())[:1] == ("body",):  # no JSON object came: none, or of another type
            return error_response(ApiError(400, "the body must be a JSON object, sent as Content-Type: "
                                                f"application/json (got {request.headers.get('content-type')!r})"))
        return error_response(ApiError(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", where))

    # What Starlette and FastAPI answer by themselves (an unknown path, a method a path does not take, a body
    # that is not UTF-8) in OpenAI's error object too, as is a bug's 500.
    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        if isinstance(exc.__cause__, UnicodeDecodeError):
            return error_response(ApiError(400, f"the body is not valid UTF-8: {exc.__cause__}"))
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.url.path} does not take {request.method}"}.get(exc.status_code, str(exc.detail))
        return error_response(ApiError(exc.status_code, message), exc.headers)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health():
        state.ready()
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        served = state.served
        snapshot = await served.engine.snapshot() if served else None
        return PlainTextResponse(metrics.render(snapshot, served.counters if served else None,
                                                served.model_name if served else ""),
                                 media_type="text/plain; version=0.0.4")

    @v1.get("/models")
    async def models():
        served = state.ready()
        return {"object": "list", "data": [{
            "id": served.model_name, "object": "model", "created": int(time.time()), "owned_by": "pagedchat",
            "root": served.model_name, "max_model_len": served.max_model_len}]}

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletion, request: Request):
        served = state.ready()
        check_model(served, body.model)
        body.refuse_what_cannot_be_honoured()
        session_key = request.headers.get("x-session-id") or body.session_id or body.user
        turn = served.sessions.turn(session_key, body.messages, body.n) if served.sessions is not None else None
        if turn is None:
            prompt = encode_chat(served.tokenizer, body.messages)
            request_id, continued, keep = f"chatcmpl-{uuid.uuid4().hex}", False, False
            context_ids = prompt
        else:
            prompt, request_id, continued, keep = turn.prompt, turn.request_id, turn.continued, True
            context_ids = turn.context_ids
        params = body.sampling_params(room_after(served, len(context_ids)))
        run = Run(served, request_id, prompt, params, keep, continued, context_ids)
        if turn is not None:
            run.on_finish, run.on_abandon = turn.finish, turn.abandon
        return await respond(run, body, request, chat=True)

    @v1.post("/completions")
    async def completions(body: TextCompletion, request: Request):
        served = state.ready()
        check_model(served, body.model)
        body.refuse_what_cannot_be_honoured()
        prompt = body.prompt_one()
        prompt_ids = served.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = body.sampling_params(room_after(served, len(prompt_ids)))
        run = Run(served, f"cmpl-{uuid.uuid4().hex}", prompt_ids, params, False, False, prompt_ids)
        return await respond(run, body, request, chat=False)

    @app.post("/tokenize")
    async def tokenize(body: Tokenize):
        served = state.ready()
        if body.messages is not None:
            tokens = encode_chat(served.tokenizer, body.messages, body.add_generation_prompt)
        elif body.prompt is not None:
            tokens = served.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise ApiError(400, "give a prompt or messages")
        return {"count": len(tokens), "max_model_len": served.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: Detokenize):
        served = state.ready()
        return {"prompt": served.tokenizer.decode(body.tokens)}

    @v1.get("/kv/snapshot")
    async def kv_snapshot():
        return snapshot_to_json(await state.ready().engine.snapshot())

    @v1.get("/kv/events")
    async def kv_events(request: Request, since: int | None = None):
        served = state.ready()
        return StreamingResponse(block_events(served, request, since), media_type="text/event-stream")

    app.include_router(v1)
    return app


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def check_model(served: Served, model: str | None) -> None:
    if model is not None and model != served.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server has {served.model_name!r}", "model")


def encode_chat(tokenizer, messages, add_generation_prompt: bool = True) -> list[int]:
    conversation = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in messages]
    return chat_prompt(tokenizer, conversation, add_generation_prompt)


def room_after(served: Served, context: int) -> int:
    room = served.max_model_len - context
    if room < 1:
        raise ApiError(400, f"the prompt is {context} tokens, but this model's context (and KV pool) holds "
                            f"{served.max_model_len}: shorten it", "messages")
    return room


@dataclass
class Run:
    """One completion request on its way through the engine."""

    served: Served
    request_id: str
    prompt: list[int]
    params: object
    keep: bool
    continued: bool
    context_ids: list[int]  # the tokens before the reply: the prompt (all turns of a session)
    on_finish: Callable[[RequestOutput], None] | None = None
    on_abandon: Callable[[], None] | None = None  # the client left before the end

    def outputs(self, until: asyncio.Future) -> AsyncIterator[RequestOutput]:
        return self.served.engine.generate(self.request_id, self.prompt, self.params, self.keep, self.continued,
                                           until=until)

    def finished(self, output: RequestOutput) -> None:
        self.served.counters.add(output, len(self.context_ids))
        if self.on_finish is not None:
            self.on_finish(output)

    def abandoned(self) -> None:
        if self.on_abandon is not None:
            self.on_abandon()


async def respond(run: Run, body, request: Request, chat: bool):
    outputs = until_disconnected(run, request)
    if body.stream:
        return StreamingResponse(stream(run, outputs, body, chat), media_type="text/event-stream")
    final = None
    try:
        async for final in outputs:
            pass
    except EngineFailure as exc:
        raise ApiError(exc.status, str(exc)) from exc
    if final is None or not final.finished:
        run.abandoned()
        return Response(status_code=499)  # the client left; nobody reads this
    run.finished(final)
    return whole_response(run, final, body, chat)


async def until_disconnected(run: Run, request: Request) -> AsyncIterator[RequestOutput]:
    """The run's outputs until the last one or until the client leaves, whichever is first; leaving stops
    the request (the outputs' generator ends it). Starlette does not watch for a disconnect while a stream
    has nothing to send, and a paused or busy engine sends nothing: so this does."""
    gone = asyncio.ensure_future(disconnected(request))
    outputs = run.outputs(until=gone)
    try:
        async for output in outputs:
            yield output
    finally:
        gone.cancel()
        await outputs.aclose()


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def whole_response(run: Run, final: RequestOutput, body, chat: bool) -> dict:
    choices = []
    for out in final.outputs:
        choice = {"index": out.index, "finish_reason": out.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        if body.return_token_ids:
            choice["token_ids"] = out.token_ids
        choices.append(choice)
    response = {"id": run.request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": run.served.model_name, "choices": choices,
                "usage": usage(run, final)}
    if body.return_token_ids:
        response["prompt_token_ids"] = run.context_ids
    return response


def usage(run: Run, final: RequestOutput) -> dict:
    completion = sum(len(out.token_ids) for out in final.outputs)
    context = len(run.context_ids)
    return {"prompt_tokens": context, "completion_tokens": completion, "total_tokens": context + completion,
            "prompt_tokens_details": {"cached_tokens": final.num_cached_tokens}}


async def stream(run: Run, outputs: AsyncIterator[RequestOutput], body, chat: bool) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())

    def chunk(choices: list[dict], **extra) -> str:
        payload = {"id": run.request_id, "object": kind, "created": created, "model": run.served.model_name,
                   "choices": choices, **extra}
        return f"data: {json.dumps(payload)}\n\n"

    if chat:
        first = {"role": "assistant", "content": ""}
        yield chunk([{"index": i, "delta": first, "logprobs": None, "finish_reason": None} for i in range(body.n)],
                    **({"prompt_token_ids": run.context_ids} if body.return_token_ids else {}))
    final = None
    try:
        async for final in outputs:
            choices = []
            for out in final.outputs:
                silent = not out.new_text and not (body.return_token_ids and out.new_token_ids)
                if silent and out.finish_reason is None:
                    continue  # a token that ends mid-character: its text comes with the next one
                choice = {"index": out.index, "logprobs": None, "finish_reason": out.finish_reason}
                if chat:
                    choice["delta"] = {"content": out.new_text} if out.new_text else {}
                else:
                    choice["text"] = out.new_text
                if body.return_token_ids:
                    choice["token_ids"] = out.new_token_ids
                choices.append(choice)
            if choices:
                yield chunk(choices)
    except EngineFailure as exc:
        yield f"data: {json.dumps(ApiError(exc.status, str(exc)).body())}\n\n"
        yield "data: [DONE]\n\n"
        return
    if final is None or not final.finished:
        run.abandoned()
        return
    run.finished(final)
    if body.include_usage:
        yield chunk([], usage=usage(run, final))
    yield "data: [DONE]\n\n"


async def block_events(served: Served, request: Request, since: int | None) -> AsyncIterator[str]:
    """Server-sent block events from `since` on (each with its seq as the SSE id); `resync` when the
    ones asked for are no longer held."""
    held = served.engine.thread.snapshot.events
    last = since if since is not None else (held[-1].seq if held else -1)  # no since: from now on
    while not await request.is_disconnected():
        events = served.engine.thread.snapshot.events
        if events and events[0].seq > last + 1:
            yield f"event: resync\ndata: {json.dumps({'oldest': events[0].seq})}\n\n"
            last = events[0].seq - 1
        for event in events:
            if event.seq > last:
                yield f"id: {event.seq}\ndata: {json.dumps(dataclasses.asdict(event))}\n\n"
        if events:
            last = events[-1].seq
        await asyncio.sleep(EVENTS_POLL_S)
