"""Run the server: uvicorn on one event loop, the model loading in a thread meanwhile (503 until then)."""

import asyncio
import copy
import signal
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn

from pagedchat.engine.runtime.engine_thread import EngineThread
from pagedchat.engine.runtime.own_thread import in_own_thread
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


def serve(load_llm: Callable[[], object], config: ServeConfig,
          on_ready: Callable[[str], None] = print) -> signal.Signals | None:
    """Serve until SIGINT or SIGTERM, which it returns, once the requests in flight have ended; `on_ready` hears
    the URL once the model is loaded. A model that fails to load stops the server and raises here."""
    server, state = make_server(load_llm, config, on_ready)
    # uvicorn raises the signal that stopped it again once it has stopped, under the handlers it found: Python's
    # (a KeyboardInterrupt's traceback for ctrl+c, death by the signal for SIGTERM). These take it instead.
    found = {sig: signal.signal(sig, lambda *_: None) for sig in STOP_SIGNALS}
    try:
        server.run()
    finally:
        for sig, handler in found.items():
            signal.signal(sig, handler)
    if state.failure is not None:
        raise state.failure
    return server.stopped_by


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Server(uvicorn.Server):
    """uvicorn's server, whose stop signal also ends the requests in flight: uvicorn alone waits for each to
    finish, a reply of thousands of tokens."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.stopped_by: signal.Signals | None = None

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        self.stopped_by = self.stopped_by or signal.Signals(sig)
        if self.state.loop is not None:  # this interrupts whatever the loop's thread was running: stop after it
            self.state.loop.call_soon_threadsafe(self.state.stop)


class BackgroundServer:
    """The server on a thread and event loop of its own, serving an engine thread that the app owns
    (`serve --tui`: one engine thread for the app's tabs and the API's requests)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.server, self.state = make_server(None, config)
        self._thread = threading.Thread(target=self.server.run, name="pagedchat-server", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def attach(self, llm, engine_thread: EngineThread) -> None:
        """Serve this engine thread from now on (called from any thread; 503 until then)."""
        async def attach() -> None:
            tokenizer = await asyncio.to_thread(copy.deepcopy, llm.get_tokenizer())
            self.state.served = served_for(llm, engine_thread, tokenizer, self.config)

        while self.state.loop is None and self._thread.is_alive():  # uvicorn starts in well under a second
            time.sleep(0.01)
        if self.state.loop is not None:
            asyncio.run_coroutine_threadsafe(attach(), self.state.loop)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)


def make_server(load_llm: Callable[[], object] | None, config: ServeConfig,
                on_ready: Callable[[str], None] = print) -> tuple[Server, ServerState]:
    """The server, and the state its endpoints read; it loads the model itself unless load_llm is None."""
    state = ServerState()
    threads: list[EngineThread] = []

    def stop_on_failure(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            state.failure = task.exception()
            state.stopped = server.should_exit = True

    @asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        loading = asyncio.create_task(load(state, load_llm, config, threads, on_ready)) if load_llm else None
        if loading is not None:
            loading.add_done_callback(stop_on_failure)
        expiring = asyncio.create_task(expire_sessions(state, config.session_idle_s))
        try:
            yield
        finally:
            expiring.cancel()
            if loading is not None:
                loading.cancel()
            state.stopped = True
            for thread in threads:
                thread.stop()

    app = build_app(state, config.api_key)
    app.router.lifespan_context = lifespan
    server = Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning"), state)
    return server, state


async def expire_sessions(state: ServerState, idle_s: float) -> None:
    while True:
        await asyncio.sleep(min(1.0, idle_s / 2))
        if state.served is not None:
            state.served.sessions.expire()


async def load(state: ServerState, load_llm, config: ServeConfig, threads: list, on_ready) -> None:
    llm = await in_own_thread(load_llm)
    # The engine thread decodes with the engine's tokenizer; the event loop encodes with its own.
    tokenizer = await asyncio.to_thread(copy.deepcopy, llm.get_tokenizer())
    thread = EngineThread(llm.engine)
    thread.start()
    threads.append(thread)
    state.served = served_for(llm, thread, tokenizer, config)
    on_ready(f"http://{config.host}:{config.port}")


def served_for(llm, thread: EngineThread, tokenizer, config: ServeConfig) -> Served:
    """What the endpoints serve; called on the server's event loop."""
    engine_config = llm.engine.config
    async_engine = AsyncEngine(thread, asyncio.get_running_loop())
    max_len = min(engine_config.max_model_len, engine_config.num_kv_blocks * engine_config.block_size)
    return Served(async_engine, tokenizer, config.model_name, max_len,
                  sessions=Sessions(tokenizer, async_engine.close, config.session_idle_s, config.max_sessions))
