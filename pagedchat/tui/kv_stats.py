"""The pool in numbers, and the lesson the app exists to teach: paging against contiguous reservation."""

from rich.text import Text

from pagedchat.engine.api.snapshot import KVSnapshot
from pagedchat.tui.text_panel import TextPanel, Word, flow

LIVE = ("waiting", "running", "preempted", "parked")  # requests that hold (or will hold) blocks
BITS = {"int8": 8, "fp8": 8, "bfloat16": 16, "float16": 16, "float32": 32}


def megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size < 10e6 else f"{size / 1e6:,.0f} MB"


def memory_lines(snapshot: KVSnapshot, compact: bool = False) -> list[list[Word]]:
    """The cache's dtype, a block's bytes and the pool's, and the weights beside them; none where the
    snapshot does not say (an older server's). `compact` (a short screen): the cache's dtype and the pool's
    bytes alone, one line."""
    lines = []
    if snapshot.bytes_per_block and compact:
        return [[("", f"KV {snapshot.kv_cache_dtype}"),
                 (" · ", f"pool {megabytes(snapshot.num_blocks * snapshot.bytes_per_block)}")]]
    if snapshot.bytes_per_block:
        lines.append([("", f"KV {snapshot.kv_cache_dtype}"), (" · ", f"{snapshot.bytes_per_block:,} B/block"),
                      (" · ", f"pool {megabytes(snapshot.num_blocks * snapshot.bytes_per_block)}")])
    if snapshot.weights_bytes:
        mapped = " mapped" if "GGUF" in snapshot.weights_format else ""
        lines.append([("", f"weights {snapshot.weights_format}"),
                      (" ", f"{megabytes(snapshot.weights_bytes)}{mapped}")])
    return lines


def contiguous_blocks(snapshot: KVSnapshot) -> int:
    """Blocks an allocator reserving each live request's max length up front would hold now."""
    size = snapshot.block_size
    return sum(-(-info.max_len // size) for info in snapshot.requests if info.status in LIVE)


def stats_lines(snapshot: KVSnapshot, compact: bool = False) -> list[list[Word]]:
    """The panel's header, a line per list; each line's words break where the panel is narrow. `compact` (a
    short screen, whose rows the block tables and the event log need): the memory in one line, and not what
    the pool would hold at the other width."""
    used = snapshot.num_blocks - snapshot.num_free_blocks
    usage = 100 * used / snapshot.num_blocks if snapshot.num_blocks else 0.0
    preempted = sum(info.status == "preempted" for info in snapshot.requests)
    hits = (100 * snapshot.prefix_cache_hits / snapshot.prefix_cache_queries
            if snapshot.prefix_cache_queries else 0.0)
    contiguous = contiguous_blocks(snapshot)
    over = [(" ", Text("> pool!", style="bold"))] if contiguous > snapshot.num_blocks else []
    other_lines = []
    if snapshot.other_num_blocks and not compact:
        other = f"at {BITS[snapshot.other_kv_cache_dtype]} bits this pool would be {snapshot.other_num_blocks} blocks"
        other_lines.append([("" if i == 0 else " ", word) for i, word in enumerate(other.split())])
    return [
        *memory_lines(snapshot, compact),
        [("", Text(f"free {snapshot.num_free_blocks}/{snapshot.num_blocks} blocks", style="bold")),
         (" · ", f"{usage:.0f}% used"), (" · ", f"{snapshot.num_cached_blocks} cached")],
        [("", f"run {snapshot.num_running}"), (" · ", f"wait {snapshot.num_waiting}"),
         (" · ", f"preempted {preempted} ({snapshot.num_preemptions} total)"),
         (" · ", f"parked {snapshot.num_parked}")],
        [("", f"prefix hits {hits:.0f}%"), (" · ", f"{snapshot.tokens_per_second:.1f} tok/s"),
         (" · ", f"step {snapshot.step}")],
        [("", f"contiguous would hold {contiguous:>5} blocks"), *over],
        [("", Text(f"paging holds          {used:>5} blocks", style="bold"))],
        *other_lines,
    ]


def stats_text(snapshot: KVSnapshot, width: int | None = None, compact: bool = False) -> Text:
    return flow(stats_lines(snapshot, compact), width)


class KVStats(TextPanel):
    """`free N/M blocks` and the numbers beside it, broken at the panel's width."""

    DEFAULT_CSS = """
    KVStats {
        height: auto;
        padding: 0 1;
    }
    """

    def __init__(self, text: str = "", **kwargs) -> None:
        super().__init__(text, **kwargs)
        self._snapshot: KVSnapshot | None = None

    def on_resize(self) -> None:
        if self._snapshot is not None:
            self.show(self._snapshot)

    def show(self, snapshot: KVSnapshot) -> None:
        self._snapshot = snapshot
        self.set_text(stats_text(snapshot, self.content_region.width or None, self.screen.has_class("-short")))
