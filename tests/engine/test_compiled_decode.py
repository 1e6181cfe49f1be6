"""One compiled bucket on one tiny model: compiled in the background, then used, still equal to HF."""

import os
import threading

import pytest
import torch
import torch.nn.functional as F
from support.engine import hf_greedy, make_llm, random_prompts
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from pagedchat import SamplingParams
from pagedchat.engine.layers import plan as kernel_plan
from pagedchat.engine.worker import compiled_decode


@pytest.fixture(autouse=True)
def compiling(tmp_path, monkeypatch):
    """fp32 (the dtype of exact equality) with torch's own matmuls, the case where the engine compiles;
    inductor's cache folder as importing torch._dynamo leaves it, the user cache folder in tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    monkeypatch.setattr(kernel_plan, "linear_for", lambda dtype, device: F.linear)


def compiled_llm(path) -> tuple:
    """An LLM whose compiled step is ready, and the list its calls append to."""
    llm = make_llm(path, compile=True, num_threads=torch.get_num_threads())
    compiled = llm.engine.runner.compiled
    assert compiled.wait(timeout=900), compiled.error
    calls = []
    fn = compiled.fn
    compiled.fn = lambda *args: calls.append(1) or fn(*args)
    return llm, calls


def test_compiled_decode_matches_hf_and_serves_one_chat(tiny_model, tmp_path):
    llm, calls = compiled_llm(tiny_model)
    assert any((tmp_path / "pagedchat" / "inductor").rglob("*.py"))  # kept for the next start, not in /tmp
    prompt = random_prompts(seed=11, lengths=[21])[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24))[0]
    assert out.token_ids == hf_greedy(tiny_model, prompt, 24, min_new_tokens=24)
    assert len(calls) == 23  # every step after the prompt's
    scratch = llm.engine.runner.kv_caches[0][0][llm.engine.runner.compiled.scratch_block]
    assert torch.count_nonzero(scratch) > 0  # the warm-up wrote where the pool never reads


def test_no_compile_where_eager_multiplies_faster(tiny_model, monkeypatch):
    monkeypatch.undo()  # fp32 on oneDNN: the eager step is the faster one
    assert make_llm(tiny_model, compile=True).engine.runner.compiled is None


def test_a_chat_goes_compiled_when_its_batch_mate_finishes(tiny_model):
    """Two chats decode eagerly as a batch; once the shorter one ends, the other goes on compiled."""
    llm, calls = compiled_llm(tiny_model)
    prompts = random_prompts(seed=12, lengths=[9, 30])
    lengths = [6, 20]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in lengths])
    for prompt, n, out in zip(prompts, lengths, outs):
        assert out.token_ids == hf_greedy(tiny_model, prompt, n, min_new_tokens=n)
    assert len(calls) == 20 - 6


def test_a_new_thread_count_is_compiled_in_the_background(tiny_model):
    """The compiled step is keyed on torch's thread count: at a new count the engine serves eagerly while
    the step compiles for it, then takes it."""
    before = torch.get_num_threads()
    try:
        llm = make_llm(tiny_model, compile=True, num_threads=1)
        compiled = llm.engine.runner.compiled
        assert compiled.wait(timeout=900), compiled.error
        torch.set_num_threads(2)  # as the thread policy would
        assert not compiled.ready()
        prompt = random_prompts(seed=13, lengths=[17])[0]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12))[0]
        assert out.token_ids == hf_greedy(tiny_model, prompt, 12, min_new_tokens=12)
        assert compiled.wait(timeout=900) and compiled.ready_threads == {1, 2}
    finally:
        torch.set_num_threads(before)


def test_an_engine_on_a_thread_of_its_own_gets_its_thread_count_compiled(tiny_model):
    """As in the app and the server: the engine thread computes with fewer threads than the main thread.
    torch's count is per thread, so the step must be compiled at the engine thread's count, and then run
    there without compiling again."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the main thread's count, which a new thread starts from
    result = {}

    def engine_thread() -> None:
        llm = make_llm(tiny_model, compile=True, num_threads=1)
        compiled = llm.engine.runner.compiled
        result["ready"] = compiled.wait(timeout=900)
        frames = dict(torch._dynamo.utils.counters["frames"])
        calls = []
        fn = compiled.fn
        compiled.fn = lambda *args: calls.append(1) or fn(*args)
        prompt = random_prompts(seed=14, lengths=[13])[0]
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10))[0]
        result.update(tokens=out.token_ids, prompt=prompt, calls=len(calls),
                      recompiled=dict(torch._dynamo.utils.counters["frames"]) != frames)

    try:
        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(before)
    assert result["ready"]
    assert result["tokens"] == hf_greedy(tiny_model, result["prompt"], 10, min_new_tokens=10)
    assert result["calls"] == 9 and not result["recompiled"]


def test_a_failing_compile_is_tried_three_times_and_the_engine_serves_eagerly(tiny_model, monkeypatch):
    def without_a_compiler(fn, **options):
        def compiled(*args):
            raise RuntimeError("no C++ compiler")
        return compiled

    monkeypatch.setattr(compiled_decode.torch, "compile", without_a_compiler)
    llm = make_llm(tiny_model, compile=True, num_threads=torch.get_num_threads())
    compiled = llm.engine.runner.compiled
    prompt = random_prompts(seed=14, lengths=[10])[0]
    for _ in range(2):  # the second run finds the compile given up: no more tries
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24))[0]
        assert out.token_ids == hf_greedy(tiny_model, prompt, 24, min_new_tokens=24)
        assert not compiled.wait(timeout=60)
    assert compiled.failures == compiled_decode.MAX_TRIES and "no C++ compiler" in compiled.error


def test_compiling_says_whether_a_compile_thread_is_still_at_work():
    """The CLI leaves at once (os._exit) while one is: the interpreter's teardown would abort it in C++."""
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name=compiled_decode.THREAD_NAME, daemon=True)
    assert not compiled_decode.compiling()
    thread.start()
    assert compiled_decode.compiling()
    release.set()
    thread.join()
    assert not compiled_decode.compiling()
