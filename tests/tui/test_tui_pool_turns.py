"""A conversation that holds nearly the whole pool: the panel says why the others wait, and they all finish."""

from support.app import LONG, SIZE, loaded
from support.tui import async_test, wait_until

from pagedchat.tui.block_tables import BlockTables
from pagedchat.tui.kv_panel import KVPanel


def tables_text(app) -> str:
    return str(app.query_one(BlockTables).render())


@async_test
async def test_the_panel_says_who_holds_the_pool_while_a_tab_waits(make_app):
    # 24 blocks of 4 slots, which one conversation fills: ~57 tokens of prompt, then its reply to the end.
    async with make_app(LONG, num_kv_blocks=24, block_size=4).run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        first = app.current_pane
        await pilot.press("f5")  # paused: f6 steps it until the first tab holds most of the pool
        first.send("hi")
        while len(app.worker.snapshot.block_tables.get("chat-1.1", ())) < 20:
            step = app.worker.snapshot.step
            await pilot.press("f6")
            await wait_until(pilot, lambda step=step: app.worker.snapshot.step > step, what="one step")
        await pilot.press("ctrl+n")
        second = app.current_pane
        second.send("hi")
        panel = app.query_one(KVPanel)
        await wait_until(pilot, lambda: "chat 2 waiting" in tables_text(app), what="the second tab waiting")
        held = len(panel.snapshot.block_tables["chat-1.1"])
        free = panel.snapshot.num_free_blocks
        text = " ".join(tables_text(app).split())  # the reason wraps at the panel's width
        assert f"↳ needs 15 blocks, {free} free: chat 1 holds {held}/24, generating; they take turns" in text
        await pilot.press("f5")
        await wait_until(pilot, lambda: not first.replying and not second.replying, what="both replies")
        assert first.full and second.conversation.last_reply is not None
