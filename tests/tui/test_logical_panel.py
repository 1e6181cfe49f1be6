"""The logical view of an attached vLLM, drawn from a prefix tree built from hand-made KV events: counts
and a tree by hash, each tab matched against it block by block, never a physical position."""

import dataclasses
import random

from support.tui import async_test, wait_until
from textual.app import App, ComposeResult
from textual.widgets import Tree

from pagedchat.attach.kv_events import BlockRemoved, BlockStored, EventBatch
from pagedchat.attach.metrics import ServerMetrics
from pagedchat.attach.prefix_tree import PrefixTree
from pagedchat.attach.watch import LogicalSnapshot, rank_view
from pagedchat.tui.logical_panel import NOTICE, LogicalPanel
from pagedchat.tui.themes import SessionTag

SIZE = 16
METRICS = ServerMetrics(num_blocks=1000, block_size=SIZE, usage=0.25, running=1, waiting=2, preemptions=3,
                        prefix_queries=200, prefix_hits=50, generation_tokens=900, ranks=1)


def tag_of(request_id: str) -> SessionTag:
    return SessionTag(request_id.replace("-", " ").rsplit(".", 1)[0], int(request_id[5]))


class PanelHost(App):
    def __init__(self, texts: dict[tuple[int, ...], str]) -> None:
        super().__init__()
        self.asked: list[tuple[int, ...]] = []
        self._texts = texts

    async def detokenize(self, token_ids) -> str:
        self.asked.append(tuple(token_ids))
        return self._texts[tuple(token_ids)]

    def compose(self) -> ComposeResult:
        yield LogicalPanel(self.detokenize)


def text_of(panel: LogicalPanel, widget_id: str) -> str:
    return str(panel.query_one(widget_id).render())


@async_test
async def test_tabs_sharing_a_system_prompt_show_its_blocks_as_shared_and_an_eviction_shows():
    rng = random.Random(17)
    system = [rng.randrange(1000) for _ in range(2 * SIZE)]  # two full blocks both tabs begin with
    one = system + [rng.randrange(1000) for _ in range(SIZE + 5)]  # a third full block, and a partial one
    two = system + [rng.randrange(1000, 2000) for _ in range(SIZE)]
    a1, a2, a3, b3 = (rng.getrandbits(64) for _ in range(4))
    tree = PrefixTree()
    # vLLM reports only full blocks; the first chat's three in one event, the second's own under the system's.
    tree.apply(EventBatch(0, 0.0, (BlockStored((a1, a2, a3), None, tuple(one[:3 * SIZE]), SIZE),), 0))
    tree.apply(EventBatch(1, 0.0, (BlockStored((b3,), a2, tuple(two[2 * SIZE:]), SIZE),), 0))
    contexts = {"chat-1.1": one, "chat-2.1": two}
    snapshot = LogicalSnapshot("http://vllm", METRICS, 12.5, 0.5, True, (rank_view(0, tree, contexts),), None)
    texts = {tuple(one[i:i + SIZE]): f"block text {i // SIZE}" for i in range(0, 3 * SIZE, SIZE)}
    app = PanelHost(texts)
    async with app.run_test(size=(80, 50)) as pilot:
        panel = app.query_one(LogicalPanel)
        panel.show(snapshot, contexts, tag_of)
        await pilot.pause()
        stats = text_of(panel, "#stats")
        assert NOTICE in stats and "pool 1,000 blocks × 16 tok" in stats and "25.0% in use" in stats
        assert "run 1 · wait 2 · preemptions 3" in stats and "50% now, 25% overall · 12.5 tok/s" in stats
        tabs = text_of(panel, "#tabs").splitlines()
        assert tabs == ["■ chat 1: 3/3 blocks resident · 2 shared with chat 2",
                        "■ chat 2: 3/3 blocks resident · 2 shared with chat 1"]
        blocks = panel.query_one("#blocks", Tree)
        rank = blocks.root.children[0]
        assert str(rank.label) == "rank 0: 4 resident blocks"
        (top,) = rank.children
        assert "shared×2" in str(top.label) and [n.data.block_hash for n in top.children] == [a2]
        assert [n.data.block_hash for n in top.children[0].children] == [a3, b3]
        assert "shared" not in str(top.children[0].children[0].label)

        blocks.move_cursor(top.children[0].children[0])  # the first chat's third block: its text comes from the server
        await wait_until(pilot, lambda: "block text 2" in text_of(panel, "#block-text"), what="the block's text")
        assert app.asked == [tuple(one[2 * SIZE:3 * SIZE])]

        tree.apply(EventBatch(2, 0.0, (BlockRemoved((a3,)),), 0))
        panel.show(dataclasses.replace(snapshot, ranks=(rank_view(0, tree, contexts),)), contexts, tag_of)
        await pilot.pause()
        assert text_of(panel, "#tabs").splitlines()[0] == "■ chat 1: 2/3 blocks resident · 2 shared with chat 2"
        assert text_of(panel, "#evictions") == f"seq 2 evicted #{a3:016x}"[:23] + " (16 tok)"
        assert str(blocks.root.children[0].label) == "rank 0: 3 resident blocks"
