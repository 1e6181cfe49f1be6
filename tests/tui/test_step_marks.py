"""What one step touched: the snapshot's before-step counts on a live engine, the marks the panel draws
from them (by hand, in a picture, and in the app while it is paused)."""

import dataclasses

from support.app import loaded  # noqa: F401 (make_app is a fixture)
from support.engine import make_llm, random_prompts
from support.tui import PanelApp, async_test, make_snapshot, wait_until

from pagedchat import SamplingParams
from pagedchat.engine.api.snapshot import snapshot_from_json, snapshot_to_json
from pagedchat.tui.block_grid import MARK_GLYPHS, BlockGrid
from pagedchat.tui.block_tables import BlockTables
from pagedchat.tui.kv_panel import KVPanel
from pagedchat.tui.step_marks import StepTouch, step_marks, step_touch

SIZE = (60, 44)
THREE = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

# a.1 decoded one token into slot 3 of its last block; c.1 computed a 30-token chunk of its prompt
# (tokens 10-39: from slot 10 of block 6 to slot 7 of block 8); b.1, which shares a.1's first two
# blocks, did not run.
STEPPED = make_snapshot(
    tables={"a.1": [0, 1, 2, 3], "b.1": [0, 1, 5], "c.1": [6, 7, 8]}, fills={3: 4, 5: 12, 8: 8},
    stepped={"a.1": (51, 52), "b.1": (28, 28), "c.1": (10, 40)})


def counts(engine) -> dict[str, tuple[int, int]]:
    return {r.request_id: (r.num_computed_before_step, r.num_computed_tokens) for r in engine.kv_snapshot().requests}


def test_each_step_says_what_it_computed_chunks_decodes_and_who_waited(tiny_model):
    # One sequence at a time, 16 tokens a step: a's 20-token prompt takes two chunks while b waits.
    engine = make_llm(tiny_model, block_size=8, num_kv_blocks=32, max_num_seqs=1, max_num_batched_tokens=16,
                      max_model_len=128).engine
    a, b = random_prompts(seed=3, lengths=[20, 5])
    engine.add_request("a", a, THREE, keep=True)
    engine.add_request("b", b, THREE, keep=True)
    assert counts(engine) == {"a": (0, 0), "b": (0, 0)}
    expected = [
        {"a": (0, 16), "b": (0, 0)},  # the first chunk
        {"a": (16, 20), "b": (0, 0)},  # the prompt's rest; its first token sampled
        {"a": (20, 21), "b": (0, 0)},  # decodes: one slot a step
        {"a": (21, 22), "b": (0, 0)},  # the third token: a is parked, b's turn comes
        {"a": (22, 22), "b": (0, 5)},
    ]
    for step in expected:
        engine.step()
        assert counts(engine) == step
    engine.release_request("a")  # its blocks went back: nothing of the step's work is left in it
    assert counts(engine)["a"] == (0, 0)


def test_a_cached_prefix_counts_as_computed_before_the_step(tiny_model):
    engine = make_llm(tiny_model, block_size=8, num_kv_blocks=32, max_model_len=128).engine
    [a] = random_prompts(seed=4, lengths=[20])
    engine.add_request("a", a, THREE)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("c", a[:16] + [1, 2, 3], THREE)  # a's two full blocks are in the prefix cache
    engine.step()
    [c] = engine.kv_snapshot().requests
    assert c.num_cached_tokens == 16 and (c.num_computed_before_step, c.num_computed_tokens) == (16, 19)


def test_a_preempted_request_computed_nothing_and_recomputes_after_its_cached_prefix(tiny_model):
    # 7 blocks of 4: two 10-token prompts take 3 each, beside the one the scheduler keeps for a's reply
    # when it admits b; a's decode of position 12 takes it, and b's then preempts b.
    engine = make_llm(tiny_model, block_size=4, num_kv_blocks=7, max_model_len=24).engine
    six = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for request_id, prompt in zip("ab", random_prompts(seed=5, lengths=[10, 10])):
        engine.add_request(request_id, prompt, six)
    for _ in range(4):
        engine.step()
    assert {r.request_id: r.status for r in engine.kv_snapshot().requests}["b"] == "preempted"
    assert counts(engine) == {"a": (12, 13), "b": (0, 0)}
    while "a" in counts(engine):
        engine.step()
    engine.step()  # b's turn again
    [b_info] = engine.kv_snapshot().requests
    assert b_info.status == "running" and b_info.num_cached_tokens > 0
    assert b_info.num_computed_before_step == b_info.num_cached_tokens
    assert b_info.num_computed_tokens == b_info.num_tokens - 1  # the rest at once, and a token sampled


def test_marks_name_the_blocks_read_and_the_slots_written():
    touches = {r.request_id: step_touch(r, STEPPED.block_size) for r in STEPPED.requests}
    assert touches == {"a.1": StepTouch((0, 1, 2, 3), ((3, 3, 3),)), "b.1": None,
                       "c.1": StepTouch((6, 7, 8), ((6, 10, 15), (7, 0, 15), (8, 0, 7)))}
    # Written wins: a block a request writes is never one another only reads (copy-on-write).
    assert step_marks(STEPPED) == {0: "read", 1: "read", 2: "read", 3: "written",
                                   6: "written", 7: "written", 8: "written"}


def test_an_older_servers_json_marks_nothing():
    data = snapshot_to_json(STEPPED)
    assert snapshot_from_json(data) == STEPPED
    for request in data["requests"]:
        del request["num_computed_before_step"]
    assert step_marks(snapshot_from_json(data)) == {}


async def marks_on(pilot) -> None:
    pilot.app.query_one(KVPanel).set_step_marks(True)
    await pilot.pause()


def test_step_marks_picture(snap_compare):
    assert snap_compare(PanelApp(STEPPED), terminal_size=SIZE, run_before=marks_on)


@async_test
async def test_the_panel_marks_a_step_only_while_asked_to():
    async with PanelApp(STEPPED).run_test(size=SIZE) as pilot:
        panel, grid = pilot.app.query_one(KVPanel), pilot.app.query_one(BlockGrid)
        tables = pilot.app.query_one(BlockTables)
        assert grid.marks == {} and "↳" not in str(tables.render())
        panel.set_step_marks(True)
        await pilot.pause()
        assert grid.marks == step_marks(STEPPED)
        text = str(tables.render())
        assert "↳ read 4 blocks · wrote slot 3 of block 3" in text
        assert "↳ read 3 blocks · wrote 30 slots in 3 blocks" in text
        assert "from slot 10 of block 6 to slot 7 of block 8" in text
        panel.show(dataclasses.replace(STEPPED, step=8))  # the next snapshot keeps the marks on
        assert grid.marks == step_marks(STEPPED)
        pilot.app.theme = "paper"  # the legend's marks follow the grid's styles into the new theme
        await pilot.pause()
        legend = pilot.app.query_one("#legend").render()
        [style] = [span.style for span in legend.spans if legend.plain[span.start:span.end] == MARK_GLYPHS["written"]]
        assert style.rich_style == grid.mark_style("written")
        assert style.foreground.hex == pilot.app.theme_variables["warning"].upper()
        panel.set_step_marks(False)
        assert grid.marks == {} and "last step" not in pilot.app.query_one("#legend").render().plain


def by_hand(snapshot) -> tuple[set[int], set[int]]:
    """The blocks the last step read (whole contexts) and wrote (from the slot before_step on)."""
    read, written = set(), set()
    size = snapshot.block_size
    for r in snapshot.requests:
        if r.num_computed_tokens > r.num_computed_before_step:
            end = -(-r.num_computed_tokens // size)
            read |= set(r.block_table[:end])
            written |= set(r.block_table[r.num_computed_before_step // size:end])
    return read, written


@async_test
async def test_paused_steps_are_marked_on_a_live_engine(make_app):
    app = make_app()
    async with app.run_test(size=(160, 50)) as pilot:
        pane = (await loaded(pilot)).current_pane
        await pilot.press("f5")
        grid = app.query_one(BlockGrid)
        assert app.query_one(KVPanel).step_marks_on
        pane.send("mark my blocks")
        await wait_until(pilot, lambda: any(r.status == "waiting" for r in app.worker.snapshot.requests),
                         what="the request taken in")
        for press in ("prefill", "decode"):
            step = app.worker.snapshot.step
            await pilot.press("f6")
            await wait_until(pilot, lambda: app.query_one(KVPanel).snapshot.step == step + 1 and grid.marks,
                             what=f"the panel to draw the {press} step")
            live = app.query_one(KVPanel).snapshot
            assert live is app.worker.snapshot
            [info] = [r for r in live.requests if r.request_id == pane.conversation.request_id]
            if press == "prefill":
                assert info.num_computed_before_step == 0 and info.num_computed_tokens == info.num_tokens - 1
            else:
                assert info.num_computed_tokens - info.num_computed_before_step == 1
            read, written = by_hand(live)
            assert {b for b, mark in grid.marks.items() if mark == "written"} == written
            assert {b for b, mark in grid.marks.items() if mark == "read"} == read - written
        await pilot.press("f5")  # running again: no marks
        await wait_until(pilot, lambda: not grid.marks, what="the marks to go")
