"""Issue 16, defects 3 and 5: the app at 80x24 (the chat keeps half the width, f4 hides the panel, the
tabs fit), a closed tab's blocks named by its title in the event log, and no stale turn line."""

from support.app import SIZE, loaded, reply_done  # noqa: F401 (make_app is a fixture)
from support.tui import async_test, frozen_llm, make_snapshot, wait_until
from textual.widgets import Tab, TabbedContent

from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.event_log import EventLog
from pagedchat.tui.kv_panel import KVPanel


@async_test
async def test_at_80x24_the_chat_keeps_half_the_width_the_tabs_fit_and_f4_hides_the_panel():
    app = PagedChatApp(frozen_llm(make_snapshot(num_blocks=512)))
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        for _ in range(3):
            await app.action_new_chat()
        await pilot.pause()
        chat_area, panel = app.query_one("#chat-area"), app.query_one(KVPanel)
        await wait_until(pilot, lambda: chat_area.size.width >= 40, what="the chat to take half the width")
        bar = app.query_one("#chats").query_one("ContentTabs")
        await wait_until(pilot, lambda: bar.region.width <= chat_area.size.width
                         and all(bar.region.x <= tab.region.x and tab.region.right <= bar.region.right
                                 for tab in app.query(Tab)),
                         what="every tab label inside the tab bar")
        assert len(app.query(Tab)) == 4 and all("chat" in str(tab.label) for tab in app.query(Tab))
        await pilot.press("f4")
        await wait_until(pilot, lambda: not panel.display and chat_area.size.width == 80, what="the panel to hide")
        assert any(key.description == "Panel" for key in app.screen.query("FooterKey"))  # the footer says so
        await pilot.press("f4")
        await wait_until(pilot, lambda: panel.display and chat_area.size.width < 80, what="the panel to come back")


@async_test
async def test_a_closed_tabs_blocks_are_named_by_its_title_and_a_new_turn_clears_the_last_turns_line(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        first = (await loaded(pilot)).current_pane
        assert first.send("hello")
        await reply_done(pilot, first)
        assert "last turn" in str(first.query_one("#turn-info").render())
        assert first.send("again")
        assert "last turn" not in str(first.query_one("#turn-info").render())
        await reply_done(pilot, first)
        await app.action_new_chat()
        app.query_one(TabbedContent).active = first.id
        await pilot.press("ctrl+w")
        log = app.query_one(EventLog)
        await wait_until(pilot, lambda: any(("free" in line.text or "release" in line.text) and "chat 1" in line.text
                                            for line in log.lines), what="the log to name the closed tab's blocks")
        assert "chat-1" not in "".join(line.text for line in log.lines)


@async_test
async def test_a_long_block_table_goes_on_over_lines_and_shows_every_block_id():
    import random

    from support.tui import PanelApp

    from pagedchat.tui.block_tables import BlockTables

    table = random.Random(5).sample(range(200, 400), 60)  # three-digit ids: far more than one line holds
    app = PanelApp(make_snapshot(num_blocks=400, tables={"a.1": table}))
    async with app.run_test(size=(100, 60)) as pilot:
        await pilot.pause()
        tables = app.query_one(BlockTables)
        lines = tables.render().plain.splitlines()
        assert len(lines) > 2 and all(len(line) <= tables.content_region.width for line in lines)
        assert [int(word) for line in lines for word in line.split(":")[-1].split()] == table
