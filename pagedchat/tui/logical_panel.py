"""The KV panel of an attached vLLM server: a logical view, drawn from its metrics and KV events.

vLLM publishes no block ids and no block tables, so nothing here stands for a physical position: the
pool is counted, the resident prefix blocks are a tree by hash (each under the block it extends), and
each tab is matched against that tree block by block. A block's text comes from the server's
/detokenize when it is selected.
"""

from collections.abc import Awaitable, Callable, Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static, Tree
from textual.widgets.tree import TreeNode

from pagedchat.attach.kv_events import Hash
from pagedchat.attach.watch import LogicalSnapshot, RankView, TreeBlock
from pagedchat.tui.text_panel import TextPanel
from pagedchat.tui.themes import SessionTag

NOTICE = "logical view: block ids are not published"
HINT = "select a block in the tree to see its text"
EVICTIONS_SHOWN = 4
BAR_WIDTH = 20


def short(block_hash: Hash) -> str:
    return (block_hash.hex() if isinstance(block_hash, bytes) else f"{block_hash & (2**64 - 1):016x}")[:8]


def stats_text(snapshot: LogicalSnapshot) -> Text:
    text = Text()
    text.append(NOTICE, style="bold italic")
    metrics = snapshot.metrics
    if metrics is None:
        text.append(f"\n{snapshot.problem or 'waiting for ' + snapshot.url + '/metrics…'}")
        return text
    filled = round(metrics.usage * BAR_WIDTH)
    pool = (f"pool {metrics.num_blocks:,} blocks × {metrics.block_size} tok" if metrics.num_blocks
            else "pool size not published")
    ranks = f" · {metrics.ranks} ranks" if metrics.ranks > 1 else ""
    text.append(f"\n{pool}{ranks}\n")
    text.append("█" * filled + "·" * (BAR_WIDTH - filled))
    # A few blocks of a large pool are well under 1%: one decimal, so that a reply's blocks show.
    text.append(f" {100 * metrics.usage:.1f}% in use\n", style="bold")
    text.append(f"run {metrics.running} · wait {metrics.waiting} · preemptions {metrics.preemptions}\n")
    hits = f"{100 * snapshot.hit_rate:.0f}%" if snapshot.hit_rate is not None else "–"
    total = f"{100 * metrics.prefix_hits / metrics.prefix_queries:.0f}%" if metrics.prefix_queries else "–"
    text.append(f"prefix hits {hits} now, {total} overall · {snapshot.tokens_per_second:.1f} tok/s")
    if snapshot.problem:
        text.append(f"\n{snapshot.problem}", style="bold")
    return text


def tabs_text(snapshot: LogicalSnapshot, contexts: dict[str, Sequence[int]],
              tag_of: Callable[[str], SessionTag], colours: dict[str, str]) -> Text:
    """Each tab: how many of its full blocks are resident, and which of them other tabs share."""
    text = Text()
    for request_id, ids in contexts.items():
        rank = max(snapshot.ranks, key=lambda view: len(view.matches.get(request_id, ())))
        mine = rank.matches.get(request_id, ())
        full = len(ids) // rank.block_size if rank.block_size else 0
        sharers = {other for other, blocks in rank.matches.items()
                   if other != request_id and mine and blocks and blocks[0] == mine[0]}
        shared = max((len(_common(mine, rank.matches[other])) for other in sharers), default=0)
        tag = tag_of(request_id)
        text.append("■ ", style=colours.get(tag.variable, ""))
        text.append(f"{tag.name}: {len(mine)}/{full} blocks resident")
        if len(snapshot.ranks) > 1:
            text.append(f" on rank {rank.rank}")
        if shared:
            text.append(f" · {shared} shared with {', '.join(tag_of(other).name for other in sorted(sharers))}",
                        style="bold")
        text.append("\n")
    text.rstrip()
    return text


def evictions_text(snapshot: LogicalSnapshot) -> Text:
    text = Text()
    for view in snapshot.ranks:
        for eviction in list(view.evictions)[-EVICTIONS_SHOWN:]:
            rank = f"rank {view.rank}: " if len(snapshot.ranks) > 1 else ""
            text.append(f"{rank}seq {eviction.seq} evicted #{short(eviction.hash)} ({eviction.tokens} tok)\n")
    text.rstrip()
    return text or Text("no evictions seen yet", style="dim")


def relabel(node: TreeNode, label: Text) -> None:
    if node.label != label:  # a new label redraws the tree: most stay the same from one picture to the next
        node.set_label(label)


def _common(a: Sequence[Hash], b: Sequence[Hash]) -> list[Hash]:
    common = []
    for x, y in zip(a, b):
        if x != y:
            break
        common.append(x)
    return common


class LogicalPanel(Vertical):
    """Stands where the block grid stands for the local engine."""

    DEFAULT_CSS = """
    LogicalPanel {
        width: 58;
        height: 1fr;
        border-left: vkey $panel;
        background: $surface;
    }
    LogicalPanel > TextPanel, LogicalPanel > Static {
        height: auto;
        padding: 0 1;
    }
    LogicalPanel > #blocks {
        height: 1fr;
        border-top: hkey $panel;
        background: $surface;
    }
    LogicalPanel > #block-text, LogicalPanel > #evictions, LogicalPanel > #tabs {
        border-top: hkey $panel;
    }
    LogicalPanel > #block-text {
        max-height: 6;
    }
    """

    def __init__(self, detokenize: Callable[[Sequence[int]], Awaitable[str]], **kwargs) -> None:
        super().__init__(**kwargs)
        self._detokenize = detokenize
        self.snapshot: LogicalSnapshot | None = None
        self._contexts: dict[str, Sequence[int]] = {}
        self._tag_of: Callable[[str], SessionTag] = SessionTag.fallback
        self._shapes: dict[int, tuple] = {}  # rank: the (block, parent) pairs its tree was built from
        self._tree_nodes: dict[tuple[int, Hash], TreeNode] = {}

    def compose(self) -> ComposeResult:
        yield TextPanel(NOTICE, id="stats")
        blocks: Tree[TreeBlock | None] = Tree("resident prefix blocks", id="blocks")
        blocks.show_root = False
        yield blocks
        yield Static(HINT, id="block-text")
        yield TextPanel(id="tabs")
        yield TextPanel(id="evictions")

    def show(self, snapshot: LogicalSnapshot, contexts: dict[str, Sequence[int]],
             tag_of: Callable[[str], SessionTag]) -> None:
        self.snapshot, self._contexts, self._tag_of = snapshot, contexts, tag_of
        self.query_one("#stats", TextPanel).set_text(stats_text(snapshot))
        colours = self.app.theme_variables
        if not snapshot.events:
            self.query_one("#tabs", TextPanel).set_text(
                Text("no KV events: start the client with --kv-events to see the resident blocks", style="dim"))
        elif snapshot.ranks:
            self.query_one("#tabs", TextPanel).set_text(tabs_text(snapshot, contexts, tag_of, colours))
            self.query_one("#evictions", TextPanel).set_text(evictions_text(snapshot))
        for view in snapshot.ranks:
            self._show_rank(view)

    def _show_rank(self, view: RankView) -> None:
        tree = self.query_one("#blocks", Tree)
        shape = tuple((block.block_hash, block.parent) for block in view.blocks)
        owners: dict[Hash, list[str]] = {}
        for request_id, blocks in view.matches.items():
            for block_hash in blocks:
                owners.setdefault(block_hash, []).append(request_id)
        if shape != self._shapes.get(view.rank):
            self._rebuild(tree, view)
            self._shapes[view.rank] = shape
        relabel(self._tree_nodes[(view.rank, None)], self._rank_label(view))
        for block in view.blocks:
            relabel(self._tree_nodes[(view.rank, block.block_hash)],
                    self._block_label(block, owners.get(block.block_hash, [])))

    def _rebuild(self, tree: Tree, view: RankView) -> None:
        selected = tree.cursor_node.data.block_hash if tree.cursor_node and tree.cursor_node.data else None
        if (old := self._tree_nodes.get((view.rank, None))) is not None:
            old.remove()
        self._tree_nodes = {key: node for key, node in self._tree_nodes.items() if key[0] != view.rank}
        rank_node = tree.root.add(self._rank_label(view), data=None, expand=True)
        self._tree_nodes[(view.rank, None)] = rank_node
        for block in view.blocks:
            parent = self._tree_nodes.get((view.rank, block.parent), rank_node) if not block.orphan else rank_node
            self._tree_nodes[(view.rank, block.block_hash)] = parent.add(
                self._block_label(block, []), data=block, expand=True, allow_expand=False)
        if selected is not None and (node := self._tree_nodes.get((view.rank, selected))) is not None:
            # once the tree has laid out its new lines: before, the cursor lands on a line that moved
            self.call_after_refresh(tree.move_cursor, node)

    def _rank_label(self, view: RankView) -> Text:
        label = Text(f"rank {view.rank}: {len(view.blocks) + view.not_drawn} resident blocks", style="bold")
        if view.not_drawn:
            label.append(f" ({view.not_drawn} not drawn)")
        if view.partial:
            label.append(" · partial since attach", style="italic")
        if view.problem:
            label.append(f" · {view.problem}")
        return label

    def _block_label(self, block: TreeBlock, owners: list[str]) -> Text:
        colours = self.app.theme_variables
        label = Text(f"#{short(block.block_hash)} {len(block.token_ids)} tok")
        if block.orphan:
            label.append(" (parent not resident)", style="dim")
        for owner in owners:
            label.append(" ■", style=colours.get(self._tag_of(owner).variable, ""))
        if len(owners) > 1:
            label.append(f" shared×{len(owners)}", style="bold")
        return label

    async def on_tree_node_highlighted(self, event: Tree.NodeHighlighted) -> None:
        block = event.node.data
        if block is not None:
            self.run_worker(self._show_text(block), exclusive=True, group="block-text")

    async def _show_text(self, block: TreeBlock) -> None:
        detail = self.query_one("#block-text", Static)
        try:
            text = await self._detokenize(block.token_ids)
        except Exception as exc:  # the server's problem, shown where the text would be
            detail.update(f"#{short(block.block_hash)}: could not fetch its text: {exc}")
            return
        head = Text(f"#{short(block.block_hash)} · {len(block.token_ids)} tokens\n", style="bold")
        detail.update(head + Text(repr(text), style="italic"))
