"""The app driven by Pilot on the tiny random model: real engine, real engine thread."""

import gc
import threading

import pytest
from support.app import LONG, SHORT, SIZE, loaded, notices, reply_done
from support.tui import async_test, frozen_llm, make_snapshot, wait_until
from support.worker import idle, watch
from textual import events
from textual.widgets import Input, TextArea

from pagedchat import LLM, SamplingParams
from pagedchat.engine.core.invariants import assert_all_free, assert_invariants
from pagedchat.engine.runtime.engine_thread import EngineThread
from pagedchat.history import History
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.block_detail import BlockDetail
from pagedchat.tui.block_grid import BlockGrid
from pagedchat.tui.chat_message import ChatMessage, visible
from pagedchat.tui.help_screen import HelpScreen
from pagedchat.tui.kv_panel import KVPanel
from pagedchat.tui.loading_screen import LoadingScreen
from pagedchat.tui.message_box import MessageBox
from pagedchat.tui.restore_screen import RestoreScreen
from pagedchat.tui.settings_screen import SettingsScreen


@pytest.fixture
def watched_worker(monkeypatch):
    """The app's engine thread gets a condition that tells when it sleeps with nothing to do
    (test_tui_worker.WatchedCondition): `idle(app.worker)`."""
    monkeypatch.setattr("pagedchat.tui.source.EngineThread", lambda *args, **kwargs: watch(EngineThread(*args, **kwargs)))


def snapshot(app: PagedChatApp):
    return app.query_one(KVPanel).snapshot


async def panel_caught_up(pilot, app: PagedChatApp) -> None:
    """The panel draws the engine's latest snapshot (it may lag by up to MAX_DRAW_GAP_S)."""
    await wait_until(pilot, lambda: snapshot(app) is app.worker.snapshot, what="the panel to catch up")


@async_test
async def test_two_tabs_reply_at_the_same_time(make_app):
    async with make_app(SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)).run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        await pilot.press("f5")  # paused, so that both requests start in the same step
        first = app.current_pane
        first.query_one(MessageBox).text = "Hello from tab one"
        await pilot.press("enter")  # enter sends
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.current_pane is not first, what="a second tab")
        second = app.current_pane
        second.send("Hello from tab two")
        assert first.replying and second.replying
        await pilot.press("f3", "f5")  # slow motion (0.25 s a step), so the UI sees every step
        await wait_until(pilot, lambda: first.replying and second.replying and first.reply_text
                         and second.reply_text, what="both replies under way")
        assert app.worker.snapshot.num_running == 2
        midway = len(first.reply_text), len(second.reply_text)
        await reply_done(pilot, first, second)
        assert len(first.conversation.last_reply.text) > midway[0]
        assert len(second.conversation.last_reply.text) > midway[1]
        assert first.query_one(MessageBox).text == ""
        assert all(len(p.conversation.last_reply.token_ids) == 12 for p in (first, second))
        assert_invariants(app.worker.snapshot)


@async_test
async def test_a_tab_shows_its_reply_so_far_as_soon_as_it_is_shown(make_app, monkeypatch):
    monkeypatch.setattr("pagedchat.tui.app.POLL_HZ", 0.01)  # no tick draws while the test runs
    async with make_app(LONG).run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        first = app.current_pane
        await pilot.press("f5")  # paused: the reply stays in progress, a step at a time
        first.send("Tell me everything")
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.current_pane is not first, what="a second tab")
        for _ in range(400):
            if len(first.reply_text) > 20:
                break
            step = app.worker.snapshot.step
            await pilot.press("f6")
            await wait_until(pilot, lambda: app.worker.snapshot.step > step, what="one more step")
        else:
            raise AssertionError(f"the reply is {len(first.reply_text)} characters after 400 steps")
        await pilot.press("f7")
        await wait_until(pilot, lambda: app.current_pane is first, what="the first tab back")
        shown = first.query(ChatMessage).last().source
        assert first.replying and len(shown) > 20 and shown == visible(first.reply_text)


@async_test
async def test_escape_stops_the_reply_and_keeps_what_came(make_app):
    async with make_app(LONG).run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        pane = app.current_pane
        pane.send("Tell me everything")
        await wait_until(pilot, lambda: len(pane.reply_text) > 3, what="a reply to start")
        await pilot.press("escape")
        await wait_until(pilot, lambda: not pane.replying, what="the reply to stop")
        kept = pane.conversation.last_reply
        assert 0 < len(kept.token_ids) < 600
        assert "stopped" in str(pane.query_one("#turn-info").render())
        info = {r.request_id: r for r in app.worker.snapshot.requests}[pane.conversation.request_id]
        assert info.status == "parked"  # the conversation stays resident for the next turn


async def loading(pilot, app: PagedChatApp) -> LoadingScreen:
    await wait_until(pilot, lambda: isinstance(app.screen, LoadingScreen), what="the loading screen")
    return app.screen


@async_test
async def test_a_message_sent_while_the_model_loads_is_answered_once_it_is_ready(make_app):
    gate = threading.Event()
    app = make_app(gate=gate)
    async with app.run_test(size=SIZE) as pilot:
        screen = await loading(pilot, app)
        screen.query_one(MessageBox).text = "hello while loading"
        await pilot.press("enter")
        assert screen.sent
        gate.set()
        await loaded(pilot)
        pane = app.current_pane
        await reply_done(pilot, pane)
        assert pane.conversation.turns[0].text == "hello while loading"
        assert pane.query_one(MessageBox).text == ""


@async_test
async def test_a_draft_typed_while_the_model_loads_waits_in_the_chat_box(make_app):
    gate = threading.Event()
    app = make_app(gate=gate)
    async with app.run_test(size=SIZE) as pilot:
        await loading(pilot, app)
        await pilot.press(*"draft")
        gate.set()
        await loaded(pilot)
        box = app.current_pane.query_one(MessageBox)
        await wait_until(pilot, lambda: box.text == "draft", what="the draft to reach the tab")
        assert app.screen.focused is box
        assert not app.current_pane.conversation.turns


@async_test
async def test_what_the_model_loaded_is_left_out_of_garbage_collections_while_the_app_runs(tiny_model):
    llm = LLM(model=tiny_model, dtype="float32", device="cpu", attention_backend="torch", num_kv_blocks=96)
    loaded_objects = [llm.engine, llm.engine.runner, llm.engine.pool, llm.get_tokenizer()]
    assert gc.get_freeze_count() == 0
    async with PagedChatApp(lambda: llm, params=SHORT).run_test(size=SIZE) as pilot:
        await loaded(pilot)
        assert gc.get_freeze_count() > 1000
        collected = {id(o) for generation in range(3) for o in gc.get_objects(generation)}
        assert not any(id(o) in collected for o in loaded_objects)
    assert gc.get_freeze_count() == 0  # given back to the collector once the app is gone
    collected = {id(o) for generation in range(3) for o in gc.get_objects(generation)}
    assert all(id(o) in collected for o in loaded_objects)


@async_test
async def test_closing_a_tab_returns_the_blocks_only_it_held(make_app):
    async with make_app().run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        first = app.current_pane
        first.send("one")
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.current_pane is not first, what="a second tab")
        second = app.current_pane
        second.send("two")
        await reply_done(pilot, first, second)
        await panel_caught_up(pilot, app)
        before = snapshot(app)
        own = [b for b in before.blocks if b.owners == (second.conversation.request_id,)]
        shared = [b for b in before.blocks if len(b.owners) == 2]
        assert own and shared  # both tabs start with the test model's default system prompt
        await pilot.press("ctrl+w")
        expected = before.num_free_blocks + len(own)
        await wait_until(pilot, lambda: snapshot(app).num_free_blocks == expected, what="the blocks to return")
        assert f"free {expected}/96 blocks" in str(app.query_one("KVStats").render())
        assert all(snapshot(app).blocks[b.block_id].ref_count == 1 for b in shared)
        assert_invariants(snapshot(app))


@async_test
async def test_clicking_a_block_shows_what_it_holds(make_app):
    async with make_app().run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        pane = app.current_pane
        pane.send("hi")
        await reply_done(pilot, pane)
        await panel_caught_up(pilot, app)
        grid = app.query_one(BlockGrid)
        # the panel draws the snapshot before the layout gives the grid its rows: a click then lands above it
        await wait_until(pilot, lambda: grid.region.height > 0, what="the grid laid out")
        await pilot.click(BlockGrid, offset=grid.cell_offset(0))
        await wait_until(pilot, lambda: grid.cursor == 0, what="block 0 selected")
        detail = str(app.query_one(BlockDetail).render())
        assert "block 0 · ref 1 · 16/16 tokens" in detail and "owners: chat 1" in detail
        assert "<|im_start|>system" in detail  # the decoded text of its tokens


@async_test
async def test_pause_then_one_step_at_a_time(make_app, watched_worker):
    async with make_app().run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        step = app.worker.snapshot.step
        await pilot.press("f5")
        pane = app.current_pane
        pane.send("step by step")
        # Once the engine thread sleeps having seen the pause and the request, no step will run.
        await wait_until(pilot, lambda: app.worker.paused and idle(app.worker), what="the paused engine to sleep")
        [info] = [r for r in app.worker.snapshot.requests if r.request_id == pane.conversation.request_id]
        assert info.status == "waiting" and info.num_computed_tokens == 0  # taken in, not started
        assert app.worker.snapshot.step == step and pane.replying
        for expected in (step + 1, step + 2):
            await pilot.press("f6")
            await wait_until(pilot, lambda: app.worker.snapshot.step >= expected and idle(app.worker),
                             what=f"step {expected}, then the engine asleep")
            assert app.worker.snapshot.step == expected and pane.replying  # one step a press, no more
            await wait_until(pilot, lambda: snapshot(app).step == expected, what=f"the panel at step {expected}")
        await pilot.press("f5")
        await reply_done(pilot, pane)


@async_test
async def test_fork_shares_the_history_blocks(make_app):
    async with make_app().run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        source = app.current_pane
        source.send("branch here")
        await reply_done(pilot, source)
        await pilot.press("ctrl+f")
        await wait_until(pilot, lambda: app.current_pane is not source, what="the fork's tab")
        fork = app.current_pane
        src_id, fork_id = source.conversation.request_id, fork.conversation.request_id
        await wait_until(pilot, lambda: fork_id in app.worker.snapshot.block_tables, what="the forked request")
        at_fork = app.worker.snapshot
        table = at_fork.block_tables[src_id]
        assert at_fork.block_tables[fork_id] == table
        assert all(at_fork.blocks[b].ref_count == 2 for b in table)
        assert [t.text for t in fork.conversation.turns] == [t.text for t in source.conversation.turns]
        [info] = [r for r in at_fork.requests if r.request_id == src_id]
        assert info.num_computed_tokens % at_fork.block_size, "the fork point must be mid-block for a copy"
        last = len(table) - 1  # the shared partial block: whichever writes into it first copies it
        fork.send("a different follow-up")
        source.send("the original follow-up")
        await reply_done(pilot, fork, source)
        after = app.worker.snapshot
        assert_invariants(after)
        [cow] = [e for e in after.events if e.kind == "cow" and e.seq > at_fork.events[-1].seq]
        assert cow.request_id in (src_id, fork_id)
        writer, other = (src_id, fork_id) if cow.request_id == src_id else (fork_id, src_id)
        tables = after.block_tables
        assert tables[writer][:last] == tables[other][:last] == table[:last]  # the full blocks stay shared
        assert all(after.blocks[b].ref_count == 2 for b in table[:last])
        assert tables[writer][last] == cow.block_id != table[last]  # its copy of the partial block
        assert tables[other][last] == table[last]  # the other one kept the original, now its own
        assert after.blocks[table[last]].ref_count == after.blocks[cow.block_id].ref_count == 1


@async_test
async def test_regenerate_replaces_the_last_reply(make_app):
    async with make_app(SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)).run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        pane = app.current_pane
        pane.send("roll the dice")
        await reply_done(pilot, pane)
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: pane.conversation.request_id == "chat-1.2", what="a new request")
        await reply_done(pilot, pane)
        assert [t.role for t in pane.conversation.turns] == ["user", "assistant"]
        assert len(pane.query(ChatMessage).filter(".-assistant")) == 1


@async_test
async def test_a_full_context_says_so_and_offers_a_new_chat(make_app):
    async with make_app(max_model_len=128).run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        pane = app.current_pane
        pane.send("hi")  # ~57 tokens with the system prompt, and a 24-token reply
        await reply_done(pilot, pane)
        # the byte tokenizer: 40 tokens, which a new chat takes but this one has no room left for
        assert not pane.send("x" * 40)
        assert pane.full and len(pane.conversation.turns) == 2
        await pilot.pause()
        await pilot.click(".new-chat")
        await wait_until(pilot, lambda: app.current_pane is not pane, what="a new chat")


def record_sends(app: PagedChatApp) -> list[list[int]]:
    """The prompts the app gives the engine thread from now on (new requests and next turns)."""
    sent = []
    worker, add, continue_ = app.worker, app.worker.add, app.worker.continue_
    worker.add = lambda rid, ids, *rest: (sent.append(ids), add(rid, ids, *rest))
    worker.continue_ = lambda rid, ids, *rest: (sent.append(ids), continue_(rid, ids, *rest))
    return sent


async def focused_box(pilot) -> tuple[PagedChatApp, MessageBox, list[list[int]]]:
    """The app, its first tab's message box once it has the focus, and what that tab sends from now on."""
    app = await loaded(pilot)
    box = app.current_pane.query_one(MessageBox)
    await wait_until(pilot, lambda: app.focused is box, what="the message box's focus")
    return app, box, record_sends(app)


async def still_chats(pilot, box: MessageBox, sent: list[list[int]]) -> None:
    """The tab takes a short message and replies: the only thing it sent."""
    box.clear()
    await pilot.press(*"hi", "enter")
    pane = pilot.app.current_pane
    await reply_done(pilot, pane)
    assert len(sent) == 1 and pane.conversation.turns[0].text == "hi"


@async_test
async def test_an_empty_message_is_not_sent(make_app):
    async with make_app().run_test(size=SIZE) as pilot:
        app, box, sent = await focused_box(pilot)
        await pilot.press("enter")
        box.insert("  \n\t ")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(notices(app)) >= 2, what="two notices")
        assert notices(app) == ["The message is empty: nothing to send."] * 2
        assert sent == [] and not app.current_pane.replying and app.current_pane.conversation.turns == []
        await still_chats(pilot, box, sent)


@async_test
async def test_a_pasted_megabyte_is_kept_whole_and_refused_if_it_cannot_fit(make_app):
    async with make_app().run_test(size=SIZE) as pilot:
        app, box, sent = await focused_box(pilot)
        line = "The quick brown fox jumps over the lazy dog, ünïcödé and all. " * 16 + "\n"
        text = line * (1_000_000 // len(line) + 1)
        app.post_message(events.Paste(text))  # as a terminal's bracketed paste arrives
        await wait_until(pilot, lambda: box.text == text, what="the paste in the message box")
        await pilot.press("enter")
        await wait_until(pilot, lambda: notices(app), what="the refusal")
        [refusal] = notices(app)
        assert "\n" not in refusal and f"{len(text.strip()):,} characters" in refusal and "1,024" in refusal
        assert box.text == text  # kept, to shorten
        pane = app.current_pane
        assert sent == [] and not pane.full and pane.conversation.turns == []
        assert_all_free(app.source.engine.kv_snapshot())  # the engine thread got nothing: it is idle
        await still_chats(pilot, box, sent)


@async_test
async def test_an_engine_error_shows_in_its_tab_and_the_others_go_on(make_app):
    async with make_app().run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        engine = app.source.engine
        add_request = engine.add_request

        def failing(request_id, *args, **kwargs):
            if request_id.startswith("chat-2."):
                raise RuntimeError("injected fault")
            add_request(request_id, *args, **kwargs)

        engine.add_request = failing
        first = app.current_pane
        first.send("fine")
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.current_pane is not first, what="a second tab")
        second = app.current_pane
        second.send("doomed")
        await wait_until(pilot, lambda: any("RuntimeError: injected fault" in error.source
                                            for error in second.query(ChatMessage).filter(".-error")),
                         what="the error in its tab")
        assert second.conversation.turns == [] and not second.replying
        await reply_done(pilot, first)


def test_whole_app_picture(snap_compare):
    """The whole app in one theme, nothing live: a frozen engine showing a hand-made snapshot (the
    message box's cursor does not blink)."""
    picture = make_snapshot(tables={"chat-1.1": [0, 1, 2], "x.1": [0, 1, 4]}, fills={2: 7, 4: 3}, cached=(6,))

    async def loaded_and_still(pilot):
        await loaded(pilot)
        await wait_until(pilot, lambda: snapshot(pilot.app) is not None, what="the panel")
        underline = pilot.app.query_one("#chats Underline")  # moved under the tab after a refresh
        await wait_until(pilot, lambda: underline.highlight_end > 0, what="the tab's underline")

    app = PagedChatApp(frozen_llm(picture), theme="harbor")
    app.animation_level = "none"  # the tab underline in place, not caught sliding there
    assert snap_compare(app, terminal_size=SIZE, run_before=loaded_and_still)


@async_test
async def test_help_settings_and_palette():
    app = PagedChatApp(frozen_llm(make_snapshot()), theme="harbor")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")  # reaches the dialog: the chat's escape (stop) is off under it
        assert not isinstance(app.screen, HelpScreen)

        await pilot.press("f2")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#temperature", Input).value = "-1"
        await pilot.click("#save")
        assert "temperature must be >= 0" in str(app.screen.query_one("#error").render())
        save = app.screen.query_one("#save")  # a button ignores clicks while it shows the last one
        await wait_until(pilot, lambda: not save.has_class("-active"), what="the save button to take clicks")
        app.screen.query_one("#temperature", Input).value = "0"
        app.screen.query_one("#max_tokens", Input).value = "7"
        app.screen.query_one("#system", TextArea).text = "Answer in French."
        await pilot.click("#save")
        conversation = app.current_pane.conversation
        await wait_until(pilot, lambda: conversation.params.max_tokens == 7, what="the new settings")
        assert conversation.params.temperature == 0 and not isinstance(app.screen, SettingsScreen)
        assert conversation.system_prompt == "Answer in French."

        await pilot.press("ctrl+p")
        await pilot.press(*"Theme: paper", "enter")
        await wait_until(pilot, lambda: app.theme == "paper", what="the paper theme")


@async_test
async def test_demo_tabs_chat_by_themselves(tiny_model):
    kwargs = dict(model=tiny_model, dtype="float32", device="cpu", attention_backend="torch", num_kv_blocks=128)
    async with PagedChatApp(lambda: LLM(**kwargs), demo="chat").run_test(size=SIZE) as pilot:
        app = pilot.app
        await wait_until(pilot, lambda: len(app.panes) == 4, what="four demo tabs")
        panes = list(app.panes.values())
        await wait_until(pilot, lambda: all(p.conversation.turns for p in panes), what="every tab to send")
        # The demo tabs share one long system prompt: the prefix cache stores its blocks once.
        await wait_until(pilot, lambda: any(b.ref_count > 1 for b in app.worker.snapshot.blocks),
                         what="shared prompt blocks")
        await app.run_action("toggle_demo")
        assert not app.demo.on
        # the kernel plan, said once the model has loaded
        assert notices(app, title="kernel plan") == [app.source.engine.runner.plan.describe()]


@async_test
async def test_chats_are_saved_and_offered_back(make_app, tmp_path):
    app = make_app()
    app.history = History(tmp_path / "history.sqlite3")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        pane = app.current_pane
        pane.send("remember me")
        await reply_done(pilot, pane)
        reply = pane.conversation.last_reply.text
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: len(app.panes) == 2, what="a second tab")
        await pilot.press("ctrl+w")  # a closed tab is not offered back
        await wait_until(pilot, lambda: len(app.panes) == 1, what="the tab to close")
    [saved] = History(tmp_path / "history.sqlite3").open_chats()
    assert saved.messages == [{"role": "user", "content": "remember me"}, {"role": "assistant", "content": reply}]

    again = make_app()
    again.history = History(tmp_path / "history.sqlite3")
    async with again.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: isinstance(again.screen, RestoreScreen), what="the offer")
        await pilot.press("enter")
        await wait_until(pilot, lambda: again.current_pane is not None, what="the restored tab")
        restored = again.current_pane
        assert [t.text for t in restored.conversation.turns] == ["remember me", reply]
        restored.send("and now?")  # a restored chat is not in the engine: this sends it whole
        await reply_done(pilot, restored)
        assert len(restored.conversation.turns) == 4
