"""The peer benchmark's timing and report plumbing (the peers themselves are built by bench.peers)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import peer_bench, peer_timing


def fake_engine(monkeypatch, setup_s: float, per_token_s: float):
    """A generate() that takes setup + per-token time on a fake clock, and the calls it saw."""
    clock, calls = [0.0], []
    monkeypatch.setattr(peer_timing.time, "perf_counter", lambda: clock[0])

    def generate(prompts, new_tokens):
        calls.append((len(prompts), list(new_tokens)))
        clock[0] += setup_s + per_token_s * max(new_tokens)
        return list(new_tokens)

    return generate, calls


def test_one_chat_splits_first_token_from_decode(monkeypatch):
    generate, calls = fake_engine(monkeypatch, setup_s=0.1, per_token_s=0.01)
    result = peer_timing.one_chat(generate, [1, 2, 3], 128, rounds=2)
    assert abs(result["ttft_ms"] - 110) < 1e-6
    assert abs(result["tok_s"] - 127 / (1.38 - 0.11)) < 1e-6
    assert calls == [(1, [1])] * 3 + [(1, [128])] * 2


def test_many_chats_count_every_generated_token(monkeypatch):
    generate, _ = fake_engine(monkeypatch, setup_s=0.5, per_token_s=0.01)
    result = peer_timing.many_chats(generate, [[1]] * 4, [10, 20, 30, 40], rounds=1)
    assert abs(result["tok_s"] - 100 / 0.9) < 1e-6


def test_the_section_replaces_its_own_place_in_results(tmp_path):
    results = tmp_path / "RESULTS.md"
    results.write_text("# suite\n\nold tables\n")
    peer_bench.write_into_results("## Peers\nfirst", results)
    peer_bench.write_into_results("## Peers\nsecond", results)
    text = results.read_text()
    assert text.count(peer_bench.MARK_BEGIN) == 1 and "second" in text and "first" not in text
    assert text.endswith("# suite\n\nold tables\n")


def test_no_round_takes_its_prompts_from_a_cache(tmp_path, monkeypatch):
    """The rounds repeat their prompts: pagedchat's worker runs without prefix caching (with it, a 16-chat
    round after the first skipped most of its prefill), as llama-server's requests ask (cache_prompt false)."""
    import pagedchat

    class Built(Exception):
        pass

    def llm(**settings):
        raise Built(settings)

    monkeypatch.setattr(pagedchat, "LLM", llm)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"model": "m", "dtype": "float32", "threads": 1, "kv_tokens": 4096,
                               "max_model_len": 512}))
    monkeypatch.setattr(sys, "argv", ["peer_bench", str(job)])
    with pytest.raises(Built) as built:
        peer_bench.pagedchat_worker()
    assert built.value.args[0]["enable_prefix_caching"] is False


def test_the_pagedchat_worker_imports_no_peer_model_code():
    """The worker's peak RSS is pagedchat's: importing the module it runs from brings neither the HF peers'
    harness nor transformers' model code (~100 MB resident) into it."""
    code = ("import sys; import bench.peer_bench; "
            "print(sorted(m for m in sys.modules if m in ('bench.hf_peers', 'transformers.modeling_utils')))")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300,
                          cwd=Path(peer_bench.__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
