"""Run the server: uvicorn on one event loop, the model loading in a thread meanwhile (503 until then)."""

import asyncio
import copy
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn

from pagedchat.engine.engine_thread import EngineThread
from pagedchat.serve.async_engine import AsyncEngine
from pagedchat.serve.server import Served, ServerState, build_app
from pagedchat.serve.sessions import Sessions

@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str = "pagedchat"
    session_idle_s: float = 600.0
    max_sessions: int = 64


def serve(load_llm: Callable[[], object], config: ServeConfig, on_ready: Callable[[str], None] = print) -> None:
    """Serve until interrupted; `on_ready` hears the URL once the model is loaded. A model that fails to
    load stops the server and raises here."""
    server, state = make_server(load_llm, config, on_ready)
    server.run()
    if state.failure is not None:
        raise state.failure


def make_server(load_llm: Callable[[], object], config: ServeConfig,
                on_ready: Callable[[str], None] = print) -> tuple[uvicorn.Server, ServerState]:
    state = ServerState()
    threads: list[EngineThread] = []

    def stop_on_failure(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            state.failure = task.exception()
            state.stopped = server.should_exit = True

    @asynccontextmanager
    async def lifespan(app):
        loading = asyncio.create_task(load(state, load_llm, config, threads, on_ready))
        loading.add_done_callback(stop_on_failure)
        try:
            yield
        finally:
            loading.cancel()
            state.stopped = True
            for thread in threads:
                thread.stop()

    app = build_app(state, config.api_key)
    app.router.lifespan_context = lifespan
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning"))
    return server, state


async def load(state: ServerState, load_llm, config: ServeConfig, threads: list, on_ready) -> None:
    llm = await asyncio.to_thread(load_llm)
    # The engine thread decodes with the engine's tokenizer; the event loop encodes with its own.
    tokenizer = await asyncio.to_thread(copy.deepcopy, llm.get_tokenizer())
    engine = llm.engine
    thread = EngineThread(engine)
    thread.start()
    threads.append(thread)
    async_engine = AsyncEngine(thread, asyncio.get_running_loop())
    max_len = min(engine.config.max_model_len, engine.config.num_kv_blocks * engine.config.block_size)
    state.served = Served(async_engine, tokenizer, config.model_name, max_len,
                          sessions=Sessions(tokenizer, async_engine.close, config.session_idle_s, config.max_sessions))
    on_ready(f"http://{config.host}:{config.port}")
