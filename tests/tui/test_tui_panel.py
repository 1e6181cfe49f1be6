"""The KV panel drawn from hand-made snapshots: pictures, and what the grid refreshes."""

import dataclasses

from support.tui import PanelApp, async_test, events, make_snapshot

from pagedchat.tui.block_detail import BlockDetail
from pagedchat.tui.block_grid import BlockGrid, cell_for
from pagedchat.tui.event_log import EventLog
from pagedchat.tui.kv_stats import KVStats, contiguous_blocks, stats_text
from pagedchat.tui.themes import SessionTag, load_themes

SIZE = (60, 44)

# Two conversations that share a 2-block prefix; "a" has a partial last block.
SHARED = make_snapshot(
    tables={"a.1": [0, 1, 2, 3], "b.1": [0, 1, 5]}, fills={3: 5, 5: 12}, cached=(8, 9),
    events=events((3, "allocate", 0, "a.1"), (3, "allocate", 1, "a.1"), (3, "allocate", 2, "a.1"),
                  (5, "share", 0, "b.1"), (5, "share", 1, "b.1"), (5, "allocate", 5, "b.1")))

# A pool too small for three conversations: one was preempted and waits, its prefix stays cached.
PREEMPTED = make_snapshot(
    num_blocks=16, tables={"a.1": list(range(0, 7)), "b.1": list(range(7, 14)), "c.1": []},
    fills={6: 3, 13: 9}, cached=(14, 15), statuses={"c.1": "preempted"}, preemptions=1, max_len=512,
    events=events((40, "allocate", 13, "b.1"), (41, "preempt", None, "c.1"), (41, "free", 14, "c.1"),
                  (41, "free", 15, "c.1")))


def test_empty_pool_picture(snap_compare):
    assert snap_compare(PanelApp(make_snapshot(step=0)), terminal_size=SIZE)


def test_shared_blocks_picture(snap_compare):
    assert snap_compare(PanelApp(SHARED), terminal_size=SIZE)


def test_preemption_picture(snap_compare):
    assert snap_compare(PanelApp(PREEMPTED, theme="paper"), terminal_size=SIZE)


def test_cells_tell_block_states_apart():
    snap = SHARED
    tag_of = SessionTag.fallback
    looks = {i: cell_for(snap.blocks[i], snap.block_size, tag_of) for i in (0, 2, 3, 5, 8, 20)}
    assert looks[0][0] == "2" and looks[0][2] is not None  # shared: ref count on the owner's colour
    assert looks[2][0] == "█"  # full, one owner
    assert looks[3][0] == "▃"  # 5 of 16 slots: three eighths
    assert looks[5][0] == "▆"  # 12 of 16
    assert looks[8] == ("░", "block-cached", None)
    assert looks[20] == ("·", "block-free", None)


def test_stats_say_free_blocks_and_the_contiguous_lesson():
    text = stats_text(SHARED).plain
    assert f"free {SHARED.num_free_blocks}/64 blocks" in text
    # Two live requests of max_len 1024 in 16-token blocks: 2 x 64 reserved, against 5 held.
    assert contiguous_blocks(SHARED) == 128
    assert "contiguous would hold   128 blocks > pool!" in text
    assert "paging holds              5 blocks" in text


@async_test
async def test_only_changed_rows_are_refreshed():
    app = PanelApp(make_snapshot(num_blocks=1024, tables={"a.1": [0, 1]}))
    async with app.run_test(size=SIZE) as pilot:
        grid = app.query_one(BlockGrid)
        assert grid.virtual_size.height > grid.size.height  # 1,024 blocks scroll
        refreshed = []
        grid.refresh_line = refreshed.append
        app.query_one("KVPanel").show(make_snapshot(num_blocks=1024, tables={"a.1": [0, 1, 2]}, fills={2: 1}))
        await pilot.pause()
        assert refreshed == [0]  # block 2 is on the first row; nothing else is redrawn


def record_refreshes(widget) -> list[tuple[tuple, bool]]:
    """(regions, layout) of each call of the widget's refresh, which still refreshes."""
    calls = []
    refresh = widget.refresh

    def spy(*regions, layout=False, **kwargs):
        calls.append((regions, layout))
        return refresh(*regions, layout=layout, **kwargs)

    widget.refresh = spy
    return calls


@async_test
async def test_a_new_snapshot_repaints_only_the_stats_lines_that_changed():
    async with PanelApp(SHARED).run_test(size=SIZE) as pilot:
        refreshed = record_refreshes(pilot.app.query_one(KVStats))
        pilot.app.query_one("KVPanel").show(dataclasses.replace(SHARED, step=8))
        await pilot.pause()
        assert [(region.y, layout) for (region,), layout in refreshed] == [(2, False)]  # "· step 8"


@async_test
async def test_the_event_log_follows_new_events_without_a_layout():
    async with PanelApp(SHARED).run_test(size=SIZE) as pilot:
        log = pilot.app.query_one(EventLog)
        refreshed = record_refreshes(log)
        many = events(*((step, "allocate", step % 64, "a.1") for step in range(10, 110)))
        pilot.app.query_one("KVPanel").show(dataclasses.replace(SHARED, events=many))
        await pilot.pause(0.1)
        assert log.virtual_size.height == len(log.lines) > log.size.height
        assert log.scroll_y == log.max_scroll_y  # the newest event is in view
        assert not any(layout for _, layout in refreshed)


@async_test
async def test_selecting_a_block_shows_its_tokens():
    async with PanelApp(SHARED).run_test(size=SIZE) as pilot:
        grid = app_grid = pilot.app.query_one(BlockGrid)
        await pilot.click(BlockGrid, offset=grid.cell_offset(3))  # the fourth cell
        await pilot.pause()
        assert app_grid.cursor == 3
        detail = str(pilot.app.query_one(BlockDetail).render())
        assert "block 3 · ref 1 · 5/16 tokens" in detail and "'abcde'" in detail
        await pilot.press("right")  # keyboard selection moves on to block 4 (free)
        assert "block 4 · ref 0" in str(pilot.app.query_one(BlockDetail).render())


def test_every_theme_has_the_panel_colours():
    for theme in load_themes().values():
        assert {"block-free", "block-cached", "block-shared", "session-7"} <= set(theme.variables)
