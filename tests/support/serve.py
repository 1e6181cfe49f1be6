"""Shared by the tests of several modules."""

import socket
import threading
import time

import httpx
import openai

from pagedchat.serve.run import ServeConfig, make_server
from support.engine import make_llm

KEY = "test-key"


POOL = dict(block_size=4, num_kv_blocks=96, max_num_seqs=4, max_num_batched_tokens=32)


GREEDY = dict(temperature=0.0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Live:
    """A server in a thread of this process: its URL, its state and the engine thread behind it."""

    def __init__(self, tiny_model) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server, self.state = make_server(lambda: make_llm(tiny_model, **POOL),
                                              ServeConfig(port=self.port, api_key=KEY, model_name="tiny"),
                                              on_ready=lambda url: None)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.state.served is not None, "the model to load", 120)
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=60)

    @property
    def engine_thread(self):
        return self.state.served.engine.thread

    def snapshot(self) -> dict:
        return self.http.get("/v1/kv/snapshot").json()

    def wait_until_idle(self) -> dict:
        """The pool once nothing runs or waits: every block free (the prefix cache counts as free)."""
        def idle() -> bool:
            snap = self.snapshot()
            return snap["num_running"] == snap["num_waiting"] == 0 and snap["num_free_blocks"] == snap["num_blocks"]
        wait_for(idle, "the pool to be whole")
        return self.snapshot()

    def stop(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(30)
