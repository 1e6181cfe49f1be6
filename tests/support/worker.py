"""Shared by the tests of several modules."""

import threading

from pagedchat.engine.runtime.engine_thread import EngineThread


class WatchedCondition(threading.Condition):
    """A condition that knows when its one waiter, the engine thread, sleeps on it unwoken.

    `asleep` is set (under the lock) as the thread starts to wait and cleared by every notify, and
    the worker notifies under the same lock with which it records each command, pause and step
    grant. So once `asleep` holds after a call, the thread has looked at everything given to it
    until then and found nothing it may do: what has not happened by then will not happen."""

    def __init__(self) -> None:
        super().__init__()
        self.asleep = False

    def wait(self, timeout=None):
        self.asleep = True
        try:
            return super().wait(timeout)
        finally:
            self.asleep = False

    def notify(self, n=1):  # notify_all comes here too
        self.asleep = False
        super().notify(n)


def watch(worker: EngineThread) -> EngineThread:
    """Give a worker, before it starts, a WatchedCondition in place of its own."""
    assert not worker._thread.is_alive()
    worker._cond = WatchedCondition()
    return worker


def idle(worker: EngineThread) -> bool:
    with worker._cond:
        return worker._cond.asleep
