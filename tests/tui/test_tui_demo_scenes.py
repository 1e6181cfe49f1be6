"""Issue 16: `--demo [SCENE]`. `pressure` runs a small pool dry (preemptions), `sharing` forks its first
tab once it has replied (the fork holds the first tab's blocks) and samples its second tab's replies three
times. Issue 32: the samples are named `#1`, `#2` in the block tables; nothing of a demo is saved."""

import re
import sqlite3

from support.app import SIZE
from support.tui import async_test, wait_until

from pagedchat import LLM
from pagedchat.cli import build_parser
from pagedchat.history import History
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.block_tables import BlockTables
from pagedchat.tui.chat_message import ChatMessage
from pagedchat.tui.demo import PROMPTS, SCENES


def scene_app(tiny_model, scene: str, num_kv_blocks: int, history: History | None = None) -> PagedChatApp:
    kwargs = dict(model=tiny_model, dtype="float32", device="cpu", attention_backend="torch",
                  num_kv_blocks=num_kv_blocks, block_size=16)
    return PagedChatApp(lambda: LLM(**kwargs), demo=scene, history=history)


@async_test
async def test_the_pressure_scene_runs_its_pool_dry_and_the_engine_preempts(tiny_model):
    app = scene_app(tiny_model, "pressure", SCENES["pressure"].num_blocks)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: len(app.panes) == 6, what="six demo tabs", timeout=60)
        prompts = {pane.conversation.system_prompt for pane in app.panes.values()}
        assert prompts == set(PROMPTS)  # nothing shared: each tab's blocks are its own
        await wait_until(pilot, lambda: app.worker.snapshot.num_preemptions > 0, what="a preemption", timeout=120)


@async_test
async def test_the_sharing_scene_forks_its_first_tab_and_the_forks_share_its_blocks_and_nothing_is_saved(
        tiny_model, tmp_path):
    database = tmp_path / "history.sqlite3"
    app = scene_app(tiny_model, "sharing", 256, History(database))
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: len(app.panes) == 3, what="two tabs and a fork", timeout=120)
        titles = sorted(pane.title for pane in app.panes.values())
        assert titles == ["demo 1", "demo 1′", "demo 2"]
        first, fork = (next(p for p in app.panes.values() if p.title == title) for title in ("demo 1", "demo 1′"))
        await wait_until(pilot, lambda: fork.is_mounted and fork.conversation.request_id is not None, what="the fork")

        def shared_by_both() -> bool:
            ids = {first.conversation.request_id, fork.conversation.request_id}
            return any(ids <= set(b.owners) for b in app.worker.snapshot.blocks)

        await wait_until(pilot, shared_by_both, what="blocks shared by the first tab and its fork", timeout=60)
        # The fork has sent a message of its own: a saved chat would hold it by now.
        await wait_until(pilot, lambda: len(fork.conversation.turns) > 2, what="the fork's own question", timeout=60)
        with sqlite3.connect(database) as saved:
            assert saved.execute("SELECT count(*) FROM chats").fetchone() == (0,)
        assert app.history.open_chats() == []  # nothing offered back at the next start


@async_test
async def test_the_sharing_scenes_second_tab_samples_each_reply_three_times_in_branches_named_1_and_2(tiny_model):
    app = scene_app(tiny_model, "sharing", 256)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: len(app.panes) >= 2, what="the two tabs", timeout=60)
        pane = next(p for p in app.panes.values() if p.title == "demo 2")
        assert pane.conversation.params.n == 3 and next(iter(app.panes.values())).conversation.params.n == 1

        def notes() -> list[str]:
            return [m.source for m in pane.query(ChatMessage) if m.role == "notice"]

        await wait_until(pilot, lambda: any(notes()), what="the first reply's samples", timeout=120)  # mounted empty, then filled
        reply = pane.conversation.turns[1].text
        request = pane.conversation.request_id
        samples = [info for info in app.worker.snapshot.requests if info.request_id == request]
        assert [info.seq_id for info in samples] == [request, f"{request}#1", f"{request}#2"]
        # The prompt's full blocks are the same blocks in all three tables; each reply has blocks of its own.
        tables = [app.worker.snapshot.block_tables[info.seq_id] for info in samples]
        assert tables[0][:3] == tables[1][:3] == tables[2][:3]  # the system prompt alone fills more than 3
        assert len({table[-1] for table in tables}) == 3
        note = notes()[0]
        assert "3 samples of this reply" in note and "**Sample 2:**" in note and "**Sample 3:**" in note
        assert "**Sample 1:**" not in note and reply  # the first is the chat's own reply

        def tables_named() -> list[str]:
            return re.findall(r"(?m)^■ (demo 2(?: #\d)?) \w+ · ", str(app.query_one(BlockTables).render()))

        await wait_until(pilot, lambda: len(tables_named()) == 3, what="three block tables of demo 2")
        assert tables_named() == ["demo 2", "demo 2 #1", "demo 2 #2"]


def test_demo_takes_a_scene_and_defaults_to_chat():
    parser = build_parser()
    assert parser.parse_args(["--demo"]).demo == "chat"
    assert parser.parse_args(["--demo", "pressure"]).demo == "pressure"
    assert parser.parse_args([]).demo is None
