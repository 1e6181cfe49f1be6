"""The thread policy: torch computes with the cores that other processes leave free."""

import subprocess
import sys
import time

import pytest
import torch

from pagedchat.engine.runtime import threads
from pagedchat.engine.runtime.threads import ThreadPolicy


def test_threads_are_the_free_cores(monkeypatch):
    policy = ThreadPolicy(cores=4)
    assert [policy.threads_for(others) for others in (0.0, 0.4, 0.6, 1.0, 2.2, 3.9, 8.0)] == [4, 4, 3, 3, 2, 1, 1]


def test_update_follows_what_others_used(monkeypatch):
    """Fake /proc readings: 2 cores; others busy 1 core-second per second, then none."""
    clock = {"t": 100.0, "busy": 0, "own": 0}
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(threads, "_machine_busy_ticks", lambda: clock["busy"])
    monkeypatch.setattr(threads, "_own_ticks", lambda: clock["own"])
    before = torch.get_num_threads()
    try:
        policy = ThreadPolicy(cores=2)
        policy.available = True
        policy._last = policy._sample()

        def second(others: float, own: float) -> int:
            clock["t"] += 1.0
            clock["own"] += int(own * threads._CLOCK_TICKS)
            clock["busy"] += int((others + own) * threads._CLOCK_TICKS)
            policy.update()
            return torch.get_num_threads()

        assert second(others=1.0, own=1.0) == 1
        assert second(others=0.0, own=1.0) == 2
        clock["t"] += 0.5  # within the interval: nothing re-read
        clock["busy"] += 10 * threads._CLOCK_TICKS
        policy.update()
        assert torch.get_num_threads() == 2
        # idle for a minute while others were busy (a server between requests): that minute is not counted
        clock["t"] += 60.0
        clock["busy"] += 60 * 2 * threads._CLOCK_TICKS
        policy.update()
        assert torch.get_num_threads() == 2
        clock["t"] += 0.3  # decided anew soon after: others busy a core meanwhile
        clock["own"] += int(0.3 * threads._CLOCK_TICKS)
        clock["busy"] += int(0.3 * 2 * threads._CLOCK_TICKS)
        policy.update()
        assert torch.get_num_threads() == 1
        clock["t"] += 0.3  # then at the usual interval again
        clock["busy"] += int(0.3 * 2 * threads._CLOCK_TICKS)
        policy.update()
        assert torch.get_num_threads() == 1
        assert second(others=0.0, own=2.0) == 2
    finally:
        torch.set_num_threads(before)


def test_a_real_busy_neighbour_is_seen():
    """Read from /proc: a process spinning beside us counts as about one busy core."""
    policy = ThreadPolicy()
    neighbour = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass"])
    try:
        time.sleep(1.5)
        policy._last = policy._sample()
        time.sleep(1.0)
        assert 0.5 <= policy.others_busy(policy._sample()) <= policy.cores + 0.5
    finally:
        neighbour.kill()
        neighbour.wait()


def test_the_engine_follows_the_policy_unless_given_a_count(tiny_model):
    from support.engine import make_llm

    before = torch.get_num_threads()
    try:
        assert isinstance(make_llm(tiny_model).engine.threads, ThreadPolicy)
        fixed = make_llm(tiny_model, num_threads=1).engine
        assert fixed.threads is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_in_own_thread_returns_or_raises_from_a_thread_that_then_ends():
    import asyncio
    import threading

    from pagedchat.engine.runtime.own_thread import in_own_thread

    def where() -> tuple[int, str]:
        return threading.get_ident(), threading.current_thread().name

    def fails() -> None:
        raise ValueError("not a model")

    async def main():
        ident, name = await in_own_thread(where)
        assert ident != threading.get_ident() and name == "pagedchat-load"
        with pytest.raises(ValueError, match="not a model"):
            await in_own_thread(fails)
        for thread in threading.enumerate():  # gone, and its OpenMP workers with it
            if thread.name == "pagedchat-load":
                thread.join(5)
                assert not thread.is_alive()

    asyncio.run(main())
