"""`pagedchat serve --tui` in tmux: an HTTP client's session shows in the app's KV panel, and its blocks
go back to the pool once the session closes."""

import re
import shutil

import httpx
import pytest
from support.serve import free_port, wait_for
from support.terminal import STARTUP_S, Terminal, pagedchat

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (apt-get install tmux); .ci/run installs it")


def test_an_api_session_is_drawn_beside_the_tabs_and_freed_after(tiny_model, tmp_path):
    port = free_port()
    term = Terminal(pagedchat("serve", "--tui", "--model", str(tiny_model), "--dtype", "float32", "--device", "cpu",
                              "--num-blocks", "64", "--port", str(port), "--session-idle", "3", state=tmp_path))
    try:
        term.wait_for(r"free 64/64 blocks", STARTUP_S)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, "the server to serve the app's engine")
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hello from an HTTP client"}], "max_tokens": 40,
            "ignore_eos": True, "temperature": 0, "session_id": "from-curl"}).json()
        request_id = reply["id"]
        held = len(httpx.get(f"{url}/v1/kv/snapshot").json()["block_tables"][request_id])
        assert held > 0
        # The panel names the request (cut to fit) and its blocks, in the pool's count.
        term.wait_for(re.escape(request_id[:13]) + r"….*parked", 30)
        term.wait_for(rf"free {64 - held}/64 blocks", 30)
        term.wait_for(r"free 64/64 blocks", 30)  # the idle session closed: its blocks went back
        assert request_id not in httpx.get(f"{url}/v1/kv/snapshot").json()["block_tables"]
        term.keys("C-q")
        term.wait_for(r"exit=0", 30)
    finally:
        term.close()
