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


# The app's settings (issue 16: replies streamed in bursts a second apart, a tab's count up to 5 s old).
# The app's tick (`_poll`) runs on a POLL_HZ grid, each tick late by whatever the UI thread was busy
# with; it draws (the reply on show, the panel, the labels) when its budget says so, and a streaming
# tab's count relabels at a draw once LABEL_COUNT_EVERY_S have passed since the last relabel.

DRAW_CPU_S = 0.05  # a dear draw: a layout of a big screen on a slow terminal, more than any measured
LATE_S = (0.0, 0.04, 0.01, 0.0, 0.03, 0.0, 0.0, 0.04, 0.02, 0.0, 0.0)  # how late each tick runs, cycled


def app_ticks(seconds: float) -> list[float]:
    """When the app's draws happen over `seconds` of streaming, by the app's own budget."""
    from pagedchat.tui.frame_budget import MAX_DRAW_GAP_S, POLL_HZ, UI_CPU_SHARE

    clocks = Clocks()
    frames = FrameBudget(UI_CPU_SHARE, MAX_DRAW_GAP_S, clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu)
    start, draws = clocks.wall, []
    for tick in range(int(seconds * POLL_HZ)):
        clocks.wall = start + tick / POLL_HZ + LATE_S[tick % len(LATE_S)]
        clocks.cpu += 0.002  # the tick itself: the tabs catch up with the engine
        if frames.due():
            draws.append(clocks.wall)
            clocks.cpu += DRAW_CPU_S
    return draws


def test_the_apps_budget_redraws_a_streaming_reply_at_least_every_250_ms():
    from pagedchat.tui.frame_budget import UI_CPU_SHARE

    assert DRAW_CPU_S / UI_CPU_SHARE > 1.0  # the share alone would wait over a second after each draw
    draws = app_ticks(10.0)
    gaps = [b - a for a, b in zip(draws, draws[1:])]
    assert max(gaps) <= 0.25, f"the reply on show waits up to {max(gaps):.2f} s between redraws"


def test_a_streaming_tabs_count_is_at_most_a_second_old():
    from pagedchat.tui.tab_labels import LABEL_COUNT_EVERY_S

    relabels = []
    for drawn_at in app_ticks(10.0):  # the count changes at every step: each draw has a newer one
        if not relabels or drawn_at - relabels[-1] >= LABEL_COUNT_EVERY_S:
            relabels.append(drawn_at)
    ages = [b - a for a, b in zip(relabels, relabels[1:])]
    assert max(ages) <= 1.0, f"a tab's token count stands for up to {max(ages):.2f} s"
