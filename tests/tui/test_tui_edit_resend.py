"""Issue 16: edit and resend an earlier message. ctrl+o lists the tab's messages; the one chosen opens a
new tab holding the turns before it, its text in the box to edit; sent, the new conversation shares the
old one's full blocks through the prefix cache and allocates its own after them."""

from support.app import SIZE, loaded, notices, reply_done  # noqa: F401 (make_app is a fixture)
from support.tui import async_test, frozen_llm, make_snapshot, wait_until
from textual.widgets import OptionList

from pagedchat.history import History
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.conversation import Turn
from pagedchat.tui.edit_screen import EditScreen, shortened
from pagedchat.tui.kv_panel import KVPanel
from pagedchat.tui.message_box import MessageBox

LONG_MESSAGE = "Explain, step by step and with an example for each, how a paged KV cache " \
               "shares the blocks of a common prefix between two conversations"


def tokens(snapshot, table: tuple[int, ...]) -> list[int]:
    return [token for block_id in table for token in snapshot.blocks[block_id].token_ids]


def common_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@async_test
async def test_ctrl_o_resends_an_edited_message_in_a_new_tab_that_shares_the_first_turns_blocks(make_app, tmp_path):
    app = make_app()
    app.history = History(tmp_path / "history.sqlite3")
    async with app.run_test(size=SIZE) as pilot:
        source = (await loaded(pilot)).current_pane
        assert source.send("first question")
        await reply_done(pilot, source)
        await pilot.press("f5")  # paused: the second reply is still on its way when the list comes up
        assert source.send("second question")
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, EditScreen), what="the list of messages")
        options = app.screen.query_one(OptionList)
        assert [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)] == \
            ["first question", "second question"]
        assert options.highlighted == 1  # the last message
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.current_pane is not source, what="the new tab")
        branch = app.current_pane
        box = branch.query_one(MessageBox)
        assert branch.title == f"{source.title} (edit)" and box.text == "second question"
        assert app.screen.focused is box and box.cursor_location == box.document.end
        first_turn = source.conversation.turns[:2]  # finished turns only: the second reply was in progress
        assert branch.conversation.turns == first_turn and branch.conversation.request_id is None

        await pilot.press("f5")
        await reply_done(pilot, source)  # its blocks are all in the prefix cache before the branch asks
        box.insert(", edited")
        await pilot.press("enter")
        await reply_done(pilot, branch)
        assert branch.conversation.turns[:3] == [*first_turn, Turn("user", "second question, edited")]
        assert len(branch.conversation.turns) == 4 and len(source.conversation.turns) == 4
        assert source.conversation.turns[2].text == "second question"

        snapshot = app.worker.snapshot
        old = snapshot.block_tables[source.conversation.request_id]
        new = snapshot.block_tables[branch.conversation.request_id]
        shared = common_length(tokens(snapshot, old), tokens(snapshot, new)) // snapshot.block_size
        # The system prompt, the first question, its reply and "second question": 116 tokens, 7 blocks of 16.
        assert shared == 7
        assert new[:shared] == old[:shared]
        assert all(snapshot.blocks[block_id].ref_count >= 2 for block_id in new[:shared])
        assert new[shared:] and not set(new[shared:]) & set(old)  # after the fork point: its own blocks
        assert all(snapshot.blocks[block_id].ref_count == 1 for block_id in new[shared:])
        info = next(r for r in snapshot.requests if r.request_id == branch.conversation.request_id)
        assert info.num_cached_tokens == shared * snapshot.block_size  # served from the old tab's blocks

        saved = {chat.title: chat.messages for chat in app.history.open_chats()}
        assert [m["content"] for m in saved[branch.title]][:3] == \
            ["first question", first_turn[1].text, "second question, edited"]
        assert len(saved[source.title]) == 4


@async_test
async def test_ctrl_o_without_a_message_says_so_and_escape_cancels_the_list():
    app = PagedChatApp(frozen_llm(make_snapshot()))
    async with app.run_test(size=SIZE) as pilot:
        pane = (await loaded(pilot)).current_pane
        await pilot.press("ctrl+o")  # no message yet: a notice, no list
        await pilot.pause()
        assert not isinstance(app.screen, EditScreen) and len(app.query("ChatPane")) == 1
        assert any("No message to edit yet" in notice for notice in notices(app))

        pane.conversation.restore([Turn("user", LONG_MESSAGE), Turn("assistant", "a reply", (97,)),
                                   Turn("user", "and then?")])
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, EditScreen), what="the list of messages")
        options = app.screen.query_one(OptionList)
        first = str(options.get_option_at_index(0).prompt)
        assert first == shortened(LONG_MESSAGE) and first.endswith("…") and len(first) < len(LONG_MESSAGE)
        await pilot.press("escape")  # reaches the list, not the chat's stop
        await wait_until(pilot, lambda: not isinstance(app.screen, EditScreen), what="the list to close")
        assert app.current_pane is pane and len(app.query("ChatPane")) == 1
        assert app.screen.focused is pane.query_one(MessageBox)

        await pilot.press("ctrl+o")  # the first message: the new tab holds nothing before it
        await wait_until(pilot, lambda: isinstance(app.screen, EditScreen), what="the list again")
        await pilot.press("up", "enter")
        await wait_until(pilot, lambda: app.current_pane is not pane, what="the new tab")
        assert app.current_pane.conversation.turns == []
        assert app.current_pane.query_one(MessageBox).text == LONG_MESSAGE
        assert pane.conversation.turns[0].text == LONG_MESSAGE  # the old tab keeps its history


def test_edit_screen_picture(snap_compare):
    """The list over the app, nothing live: a frozen engine, a tab opened with three messages, the KV
    panel hidden (this picture is the list's, not the panel's)."""

    async def list_up(pilot):
        app = await loaded(pilot)
        app.query_one(KVPanel).display = False
        conversation, _ = app.tabs.new_conversation()
        conversation.restore([Turn("user", "What is a KV cache?"), Turn("assistant", "It keeps keys.", (97,)),
                              Turn("user", LONG_MESSAGE), Turn("assistant", "Blocks are shared.", (98,)),
                              Turn("user", "And copy-on-write?")])
        await app.tabs.open(conversation, "paging", record=False)
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, EditScreen), what="the list of messages")
        await pilot.pause()

    app = PagedChatApp(frozen_llm(make_snapshot()), theme="harbor")
    app.animation_level = "none"
    assert snap_compare(app, terminal_size=(100, 30), run_before=list_up)
