"""The contiguous view: the reserve-the-maximum model, computed by hand, and the view in the panel."""

import dataclasses

from support.app import LONG, loaded  # noqa: F401 (make_app is a fixture)
from support.tui import PanelApp, async_test, frozen_llm, make_snapshot, wait_until

from pagedchat.engine.api.snapshot import RequestInfo
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.contiguous_view import (
    MODEL_LABEL,
    ContiguousView,
    Reservation,
    contiguous_model,
    contiguous_text,
    first_fit,
)
from pagedchat.tui.kv_panel import KVPanel
from pagedchat.tui.kv_stats import contiguous_blocks
from pagedchat.tui.loading_screen import LoadingScreen

SIZE = (60, 44)


def with_requests(num_blocks: int, block_size: int, *specs: tuple, tables: dict | None = None):
    """A snapshot whose requests are (request_id, status, num_tokens, max_len), in arrival order."""
    base = make_snapshot(num_blocks=num_blocks, block_size=block_size, tables=tables)
    requests = tuple(RequestInfo(rid, rid, status, tuple((tables or {}).get(rid, ())), tokens, 0, 0, max_len, 0)
                     for rid, status, tokens, max_len in specs)
    return dataclasses.replace(base, requests=requests)


# 64 blocks of 16: a asks 256/16 = 16 blocks and uses ceil(40/16) = 3, b asks 160/16 = 10 and uses 1.
FITS = with_requests(64, 16, ("a", "running", 40, 256), ("b", "waiting", 16, 160))

# 20 blocks of 4: a asks 8 (uses ceil(10/4) = 3) at 0, b asks 10 (uses 1) at 8, leaving 2 free;
# c asks 4: refused; d asks 1 (uses 1) at 18, leaving one free block, too small for c: external.
# e has finished and asks nothing.
REFUSED = with_requests(20, 4, ("a", "running", 10, 32), ("b", "preempted", 3, 40), ("c", "waiting", 5, 16),
                        ("e", "finished", 50, 400), ("d", "parked", 2, 4))


def test_all_fit_first_fit_in_arrival_order():
    model = contiguous_model(FITS)
    assert model.placed == (Reservation("a", 16, 3, 0), Reservation("b", 10, 1, 16))
    assert model.refused == ()
    assert (model.asked, model.reserved, model.used, model.internal) == (26, 26, 4, 22)
    assert (model.free, model.external) == (38, 0)  # nothing refused: the free blocks are just free
    assert model.asked == contiguous_blocks(FITS)


def test_a_request_that_does_not_fit_is_refused_and_the_hole_left_is_external_waste():
    model = contiguous_model(REFUSED)
    assert model.placed == (Reservation("a", 8, 3, 0), Reservation("b", 10, 1, 8), Reservation("d", 1, 1, 18))
    assert model.refused == (Reservation("c", 4, 2, None),)
    assert model.asked == 8 + 10 + 4 + 1 == contiguous_blocks(REFUSED)  # the finished one asks nothing
    assert (model.reserved, model.used, model.internal) == (19, 5, 14)
    assert (model.free, model.external) == (1, 1)


def test_first_fit_places_a_later_smaller_request_after_a_refusal():
    placed, refused = first_fit(10, [("a", 6, 1), ("b", 5, 5), ("c", 4, 0), ("d", 1, 1)])
    assert [(r.request_id, r.start) for r in placed] == [("a", 0), ("c", 6)]
    assert [r.request_id for r in refused] == ["b", "d"]  # the pool is full once c is in
    assert first_fit(0, [("a", 1, 0)]) == ([], [Reservation("a", 1, 0, None)])


def test_used_never_exceeds_the_reservation():
    model = contiguous_model(with_requests(8, 4, ("a", "running", 30, 8)))
    assert model.placed == (Reservation("a", 2, 2, 0),) and model.internal == 0


def test_the_text_gives_blocks_and_percent_and_paging_beside():
    held = with_requests(20, 4, *[("a", "running", 10, 32), ("b", "preempted", 3, 40), ("c", "waiting", 5, 16),
                                  ("d", "parked", 2, 4)], tables={"a": [0, 1, 2], "d": [5]})
    text = contiguous_text(held, {}).plain
    assert "a model: contiguous reservation,\nfirst-fit in arrival order" in text
    assert "reserved    19 ( 95%)  used     5 ( 25%)" in text
    assert "internal    14 ( 70%)" in text
    assert "external     1 (  5%)" in text
    assert "refused      1 of 4 live: paging serves them" in text
    assert "paging holds     4 ( 20%) for all 4 live, refuses 0" in text
    assert "none refused" in contiguous_text(FITS, {}).plain
    assert MODEL_LABEL == "a model: contiguous reservation, first-fit in arrival order"


PICTURE = with_requests(24, 16, ("chat-1.1", "running", 40, 128), ("x.1", "running", 20, 96),
                        ("y.1", "waiting", 9, 256), ("z.1", "running", 5, 32),
                        tables={"chat-1.1": [0, 1, 2], "x.1": [3, 4], "z.1": [5]})


def test_contiguous_view_picture(snap_compare):
    async def toggle(pilot):
        pilot.app.query_one(KVPanel).toggle_contiguous()
        await pilot.pause()

    assert snap_compare(PanelApp(PICTURE), terminal_size=SIZE, run_before=toggle)


@async_test
async def test_f9_shows_the_contiguous_numbers_and_hides_them_again():
    app = PagedChatApp(frozen_llm(PICTURE), theme="harbor")
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_until(pilot, lambda: app.current_pane is not None and not isinstance(app.screen, LoadingScreen),
                         what="the first tab")
        await wait_until(pilot, lambda: app.query_one(KVPanel).snapshot is not None, what="the panel")
        view = app.query_one(ContiguousView)
        assert not view.display  # hidden by default
        await pilot.press("f9")
        await pilot.pause()
        assert view.display
        text = "\n".join(line.plain for line in view._lines)
        # 8 + 6 + 16 = 30 > 24: y is refused, z (2 blocks) fits after x, 8 blocks stay free.
        assert "reserved    16 ( 67%)  used     6 ( 25%)" in text
        assert "external     8 ( 33%)" in text and "refused      1 of 4 live" in text
        assert "paging holds     6 ( 25%)" in text
        await pilot.press("f9")
        await pilot.pause()
        assert not view.display


@async_test
async def test_on_a_live_engine_paging_serves_two_chats_a_contiguous_pool_would_refuse_one_of(make_app):
    # 48 blocks of 16: each chat asks prompt + 600 tokens up front (~40 blocks); the second no longer fits.
    app = make_app(LONG, num_kv_blocks=48)
    async with app.run_test(size=(160, 50)) as pilot:
        first = (await loaded(pilot)).current_pane
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.current_pane is not first, what="the second tab")
        second = app.current_pane
        assert first.send("the first chat") and second.send("the second chat")
        await wait_until(pilot, lambda: len(first.reply_text) > 3 and len(second.reply_text) > 3,
                         what="both replies to stream")
        await pilot.press("f5")  # paused: the numbers hold still while the test reads them
        steps = []

        def still() -> bool:  # the step in flight when f5 came has ended, and no other began
            steps.append(app.worker.snapshot.step)
            return app.worker.paused and len(steps) > 3 and steps[-1] == steps[-4]

        await wait_until(pilot, still, what="the pause")
        await pilot.press("f9")
        await wait_until(pilot, lambda: app.query_one(ContiguousView).display, what="the view")
        await pilot.pause(0.6)  # a panel redraw after the last step
        live = app.worker.snapshot
        size = live.block_size
        a, b = [info for info in live.requests if info.status == "running"]
        asked_a, asked_b = -(-a.max_len // size), -(-b.max_len // size)
        assert asked_a <= 48 < asked_a + asked_b  # the premise: one fits, two do not
        held = live.num_blocks - live.num_free_blocks
        assert held == len(set(live.block_tables[a.seq_id]) | set(live.block_tables[b.seq_id])) < 48

        text = "\n".join(line.plain for line in app.query_one(ContiguousView)._lines)
        assert f"asked    {asked_a + asked_b:>5} blocks for 2 live" in text
        assert f"reserved {asked_a:>5}" in text
        assert "refused      1 of 2 live: paging serves them" in text
        assert f"paging holds {held:>5}" in text and "for all 2 live, refuses 0" in text
        assert f"{first.title:<14}" in text and f"0-{asked_a - 1}" in text and "refused" in text.splitlines()[-1]
