"""A conversation that outgrows the model's context goes on in a new tab: the system prompt and the
latest turns that fit, a branch (the full tab stays whole), and the refused message sent there."""

from support.app import SIZE, loaded, notices, reply_done
from support.tui import async_test, wait_until

from pagedchat.tui.chat_message import ChatMessage
from pagedchat.tui.message_box import MessageBox

MAX_LEN = 384


@async_test
async def test_a_full_chat_continues_in_a_new_tab_with_its_latest_turns(make_app):
    async with make_app(max_model_len=MAX_LEN).run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        full = app.current_pane
        full.conversation.set_system_prompt("Answer briefly.")
        message = "go on"
        for text in ("one", "two", "three", "four", "five", "six", "seven"):  # 24-token replies
            if not full.send(text):
                break
            await reply_done(pilot, full)
        full.query_one(MessageBox).text = message
        while full.send(message):  # until the chat has no room left for it
            await reply_done(pilot, full)
        assert full.full
        turns, request = list(full.conversation.turns), full.conversation.request_id
        assert "Continue in a new tab" in [command.title for command in app.get_system_commands(app.screen)]
        await pilot.pause()
        await pilot.click(".carry-on")
        await wait_until(pilot, lambda: app.current_pane is not full, what="the new tab")
        pane = app.current_pane
        await wait_until(pilot, lambda: any(t.text == message for t in pane.conversation.turns), what="the message sent")
        await reply_done(pilot, pane)

        kept = pane.conversation.turns[:-2]
        assert 2 <= len(kept) < len(turns) and kept == turns[-len(kept):] and kept[0].role == "user"
        assert pane.conversation.system_prompt == "Answer briefly."
        assert [t.role for t in pane.conversation.turns[-2:]] == ["user", "assistant"]
        assert pane.conversation.turns[-2].text == message  # the refused message went through
        # The branch: the full tab is as it was, and still open.
        assert full.conversation.turns == turns and full.conversation.request_id == request and full.id in app.panes
        assert full.query_one(MessageBox).text == ""  # the message moved to the new tab
        # The cost, said and true: only the tokens both chats begin with could come from the prefix cache.
        [note] = [m for m in pane.query(ChatMessage) if "computed again" in str(m.source)]
        recomputed = int(str(note.source).split(" tokens are computed again")[0].split()[-1])
        kept_tokens = full.conversation.branch("probe", kept).num_tokens
        assert recomputed > kept_tokens // 2
        info = next(r for r in app.worker.snapshot.requests if r.request_id == pane.conversation.request_id)
        assert info.num_cached_tokens <= kept_tokens - recomputed
        assert any("computed again" in n for n in notices(app))
