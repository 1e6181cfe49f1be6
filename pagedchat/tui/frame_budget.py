"""How often the UI may draw while the engine works: a share of one core's time."""

import math
import time
from collections.abc import Callable


class FrameBudget:
    """Each draw costs the UI thread CPU time (the tick's own work, then the frame Textual renders
    after it), and on the CPU machines the engine loses about as much: a core and the GIL. A draw
    is due once the time since the last one reaches that one's cost divided by `share`, or `max_gap`
    seconds, whichever is sooner: a slow terminal or a big screen lowers the frame rate, not the
    engine's token rate."""

    def __init__(self, share: float, max_gap: float, clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self.share = share
        self.max_gap = max_gap
        self._clock = clock
        self._cpu_clock = cpu_clock  # the UI thread's: call `due` from that thread only
        self._drawn_at = -math.inf
        self._drawn_cpu = 0.0
        self._cost: float | None = 0.0  # None until the first tick after a draw measures it

    def due(self) -> bool:
        """Whether to draw now; True starts the next draw's accounting."""
        if self._cost is None:  # the first tick after a draw: its frame has been rendered by now
            self._cost = self._cpu_clock() - self._drawn_cpu
        now = self._clock()
        if now - self._drawn_at < min(self._cost / self.share, self.max_gap):
            return False
        self._drawn_at, self._drawn_cpu, self._cost = now, self._cpu_clock(), None
        return True
