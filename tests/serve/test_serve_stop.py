"""`pagedchat serve` in a process of its own stops on ctrl+c (SIGINT) and SIGTERM as a server should: the requests
in flight end at once with OpenAI's error object, then one line, exit 0, no traceback."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from support.serve import free_port, wait_for


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_aborts_the_requests_in_flight_then_stops_with_one_line(sig, tiny_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # 32 samples of 1000 tokens, two requests of n = 16: the replies run for seconds, unless stopped
    server = subprocess.Popen(
        [sys.executable, "-m", "pagedchat", "serve", "--model", str(tiny_model), "--port", str(port),
         "--device", "cpu", "--dtype", "float32", "--num-blocks", "2100", "--no-compile"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        env={**os.environ, "XDG_STATE_HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path)})
    try:
        wait_for(lambda: server.poll() is not None or status(url) == 200, "the server to load the model", 120)
        assert server.poll() is None, server.stderr.read()

        refused: list[openai.APIStatusError] = []

        def whole_reply() -> None:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
            try:
                client.completions.create(model=tiny_model.name, prompt=[5, 6, 7], max_tokens=1000, n=16,
                                          extra_body={"ignore_eos": True})
            except openai.APIStatusError as error:
                refused.append(error)

        caller = threading.Thread(target=whole_reply)
        caller.start()
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "prompt": [8, 9], "max_tokens": 1000, "n": 16, "ignore_eos": True, "stream": True}) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # the reply has begun
            wait_for(lambda: running(url) == 2, "both replies to run")
            server.send_signal(sig)
            sent = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
        caller.join(30)
        _, stderr = server.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()

    assert took < 20
    last = json.loads(rest[-2][len("data: "):])  # the stream's error object, then [DONE]
    assert last["error"]["code"] == 503 and last["error"]["message"] == "the server is shutting down"
    assert rest[-1] == "data: [DONE]"
    assert not caller.is_alive() and refused and refused[0].status_code == 503
    assert refused[0].body["message"] == "the server is shutting down"
    assert server.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert stderr.splitlines()[-1] == f"pagedchat: stopped by {sig.name}", stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_model_loads_stops_with_one_line(sig, tmp_path):
    """The default model: it loads for a second or more, in a thread that a plain exit would abort."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "pagedchat", "serve", "--port", str(port), "--no-compile"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                              env={**os.environ, "XDG_STATE_HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path)})
    try:
        wait_for(lambda: server.poll() is not None or status(url) is not None, "the server to answer", 120)
        time.sleep(1.0)  # into the load's torch ops, where the old exit aborted the process
        if status(url) != 503:
            pytest.skip("the model loaded in under a second: nothing to interrupt")
        server.send_signal(sig)
        _, stderr = server.communicate(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 0, stderr
    assert stderr.splitlines()[-1] == f"pagedchat: stopped by {sig.name}", stderr
    assert "Traceback" not in stderr and "terminate called" not in stderr


def status(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def running(url: str) -> int:
    return len({request["request_id"] for request in httpx.get(f"{url}/v1/kv/snapshot").json()["requests"]})
