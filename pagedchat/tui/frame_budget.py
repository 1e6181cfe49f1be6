"""How often the UI may draw while the engine works: a share of one core's time."""

import math
import time
from collections.abc import Callable

POLL_HZ = 10  # the app's tick: it takes the engine's news and draws, frame budget permitting
UI_CPU_SHARE = 0.03  # of a core: the UI thread's while the engine works, drawing gives way
MAX_DRAW_GAP_S = 1.5 / POLL_HZ  # while the engine runs, a draw at least every other tick (half a tick spare)


class FrameBudget:
    """On the CPU machines whatever the UI thread computes the engine loses: a core and the GIL.
    Drawing is the part of that work which can wait, so it waits: a draw is due once the UI thread's
    CPU time since the last draw began (that draw, its frame, and everything else since: messages
    mounted, replies finished, keys) is at most `share` of the wall time since then, or after
    `max_gap` seconds, whichever is sooner. A slow terminal, a big screen or a busy moment lowers
    the frame rate, not the engine's token rate, down to one frame every `max_gap`: the floor that
    keeps a streaming reply moving on screen (the app's: every other tick of its poll, bench/ui_overhead.py
    measures what that costs the engine)."""

    def __init__(self, share: float, max_gap: float, clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self.share = share
        self.max_gap = max_gap
        self._clock = clock
        self._cpu_clock = cpu_clock  # the UI thread's: call `due` from that thread only
        self._drawn_at = -math.inf
        self._drawn_cpu = 0.0

    def due(self) -> bool:
        """Whether to draw now; True starts the next draw's accounting."""
        now, cpu = self._clock(), self._cpu_clock()
        if now - self._drawn_at < min((cpu - self._drawn_cpu) / self.share, self.max_gap):
            return False
        self._drawn_at, self._drawn_cpu = now, cpu
        return True
