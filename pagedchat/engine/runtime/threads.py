"""How many threads torch computes with: the cores that other processes leave free, re-read as the engine runs.

On a machine shared with other jobs, an OpenMP thread that gets descheduled makes every op wait for it
at a barrier: beside one busy neighbour process on the 2-core machines, one chat decoded at 8.9 tokens/s
with 2 threads and 26 with 1 (bench.peer_bench). So the engine counts the CPU time the rest of the machine used over the last
interval (/proc/stat's busy time less this process's own, /proc/self/stat) and computes with the cores
that are left, never fewer than one. An interval that the engine spent idle (a server between requests)
tells nothing of the load it will now compute beside, so it is dropped, and the count is decided anew
after a short interval of computing.
"""

import os
import time

import torch

CHECK_INTERVAL_S = 1.0
STALE_AFTER_S = 3 * CHECK_INTERVAL_S  # no update for this long: the engine was idle
RESUMED_INTERVAL_S = 0.25  # long enough for /proc/stat's ticks (10 ms) to tell a busy core from an idle one
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_busy_ticks() -> int:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields[:8]) - idle  # user .. steal: a stolen tick went to another guest


def _own_ticks() -> int:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime of all our threads


class ThreadPolicy:
    """Sets torch's thread count to the free cores, at most once per `CHECK_INTERVAL_S` (`RESUMED_INTERVAL_S` once
    resumed from idle); `update()` each step."""

    def __init__(self, cores: int | None = None):
        self.cores = cores or len(os.sched_getaffinity(0))
        self.available = os.path.exists("/proc/stat")
        self._last = self._sample() if self.available else None
        self._interval = CHECK_INTERVAL_S

    def _sample(self) -> tuple[float, int, int]:
        return time.monotonic(), _machine_busy_ticks(), _own_ticks()

    def others_busy(self, now: tuple[float, int, int]) -> float:
        """Cores the rest of the machine kept busy since the last sample."""
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / _CLOCK_TICKS / max(t1 - t0, 1e-6))

    def threads_for(self, others: float) -> int:
        return max(1, min(self.cores, round(self.cores - others)))

    def measure(self) -> float:
        """Cores the rest of the machine kept busy since the last measure (or since the policy was made)."""
        now = self._sample()
        busy, self._last = self.others_busy(now), now
        return busy

    def update(self) -> None:
        if not self.available:
            return
        elapsed = time.monotonic() - self._last[0]
        if elapsed > STALE_AFTER_S:
            self._last, self._interval = self._sample(), RESUMED_INTERVAL_S
            return
        if elapsed < self._interval:
            return
        self._interval = CHECK_INTERVAL_S
        threads = self.threads_for(self.measure())
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

