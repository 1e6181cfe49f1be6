"""Issue 16, defect 2: no single key loses a chat or the text being typed. ctrl+w closes a tab, and
ctrl+t brings it back (its turns, its draft, its saved history) through the engine; the editing keys
the app's keys take have alternatives, listed in f1."""

from support.app import SIZE, loaded, reply_done  # noqa: F401 (make_app is a fixture)
from support.tui import async_test, frozen_llm, make_snapshot, wait_until
from textual.widgets import Markdown

from pagedchat.history import History
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.help_screen import HelpScreen
from pagedchat.tui.message_box import SHADOWED, MessageBox


@async_test
async def test_ctrl_t_reopens_a_closed_chat_with_its_turns_draft_and_history(make_app, tmp_path):
    app = make_app()
    app.history = History(tmp_path / "history.sqlite3")
    async with app.run_test(size=SIZE) as pilot:
        pane = (await loaded(pilot)).current_pane
        assert pane.send("first question")
        await reply_done(pilot, pane)
        turns, title = list(pane.conversation.turns), pane.title
        box = pane.query_one(MessageBox)
        box.text = "a draft half typed"
        free_before = app.worker.snapshot.num_free_blocks
        await pilot.press("ctrl+w")
        await wait_until(pilot, lambda: app.current_pane is not pane, what="the tab to close")
        await wait_until(pilot, lambda: app.worker.snapshot.num_free_blocks > free_before, what="its blocks back")
        assert title not in {p.title for p in app.query("ChatPane").results()}
        assert title not in [chat.title for chat in app.history.open_chats()]  # not offered at the next start...

        await pilot.press("ctrl+t")
        await wait_until(pilot, lambda: app.current_pane is not None and app.current_pane.title == title,
                         what="the chat to come back")
        again = app.current_pane
        assert again.conversation.turns == turns and again.conversation.request_id is None
        assert again.query_one(MessageBox).text == "a draft half typed"
        assert title in [chat.title for chat in app.history.open_chats()]  # ...but kept, and open again
        assert again.send("second question")
        await reply_done(pilot, again)
        # The whole conversation went to the engine again, served from the prefix cache where it held it.
        info = str(again.query_one("#turn-info").render())
        prompt = int(info.split("prompt ")[1].split(" tok")[0])
        assert prompt > len(turns[-1].token_ids)
        assert len(again.conversation.turns) == 4

        await pilot.press("ctrl+t")  # nothing left to reopen: says so, opens nothing
        await pilot.pause()
        assert app.current_pane is again


@async_test
async def test_closing_a_tab_mid_reply_keeps_its_message_as_the_draft(make_app):
    from support.app import LONG
    app = make_app(LONG)
    async with app.run_test(size=SIZE) as pilot:
        pane = (await loaded(pilot)).current_pane
        assert pane.send("tell me everything")
        await wait_until(pilot, lambda: len(pane.reply_text) > 3, what="the reply to start")
        await pilot.press("ctrl+w")
        await wait_until(pilot, lambda: app.current_pane is not pane, what="the tab to close")
        await pilot.press("ctrl+t")
        await wait_until(pilot, lambda: app.current_pane.title == pane.title, what="the chat to come back")
        again = app.current_pane
        assert again.conversation.turns == [] and not again.replying
        assert again.query_one(MessageBox).text == "tell me everything"


@async_test
async def test_the_editing_keys_the_app_takes_have_alternatives_listed_in_f1():
    app = PagedChatApp(frozen_llm(make_snapshot()))
    async with app.run_test(size=SIZE) as pilot:
        pane = (await loaded(pilot)).current_pane
        box = pane.query_one(MessageBox)
        box.text = "one two"
        box.move_cursor((0, 7))
        await pilot.press("alt+a")  # select all, as f7 would in a bare TextArea
        assert box.selected_text == "one two"
        await pilot.press("end", "ctrl+backspace")
        assert box.text == "one "
        await pilot.press("ctrl+z", "alt+y")  # undo, then redo, as ctrl+y would
        assert box.text == "one "
        await pilot.press("f1")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), what="the help")
        help_text = app.screen.query_one(Markdown).source
        for key, _, instead in SHADOWED:
            assert f"| `{key}` |" in help_text and f"`{instead}`" in help_text
