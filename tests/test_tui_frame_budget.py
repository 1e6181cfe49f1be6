"""The UI's frame budget, on hand-driven clocks (binary fractions: exact sums)."""

from pagedchat.tui.frame_budget import FrameBudget


class Clocks:
    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 0.0


def budget(clocks: Clocks) -> FrameBudget:
    return FrameBudget(0.125, max_gap=2.0, clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu)


def test_the_next_draw_waits_for_the_last_ones_cost_over_the_share():
    clocks = Clocks()
    frames = budget(clocks)
    assert frames.due()
    clocks.cpu += 0.0625  # the draw and its frame
    clocks.wall += 0.25
    assert not frames.due()  # 62.5 ms at 12.5% buys 500 ms
    clocks.wall += 0.25
    assert frames.due()


def test_a_draw_is_due_at_least_every_max_gap():
    clocks = Clocks()
    frames = budget(clocks)
    assert frames.due()
    clocks.cpu += 1.0  # something slow: the share alone would wait 8 s
    clocks.wall += 0.25
    assert not frames.due()
    clocks.wall += 1.75
    assert frames.due()


def test_all_the_ui_threads_work_since_the_last_draw_is_charged():
    clocks = Clocks()
    frames = budget(clocks)
    assert frames.due()
    clocks.cpu += 0.0625  # the draw and its frame
    clocks.wall += 0.25
    assert not frames.due()
    clocks.cpu += 0.0625  # a reply finishes, a message is mounted
    clocks.wall += 0.25
    assert not frames.due()  # 125 ms at 12.5% buys 1 s
    clocks.wall += 0.5
    assert frames.due()
