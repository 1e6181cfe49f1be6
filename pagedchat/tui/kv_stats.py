"""The pool in numbers, and the lesson the app exists to teach: paging against contiguous reservation."""

from rich.text import Text

from pagedchat.engine.api.snapshot import KVSnapshot
from pagedchat.tui.text_panel import TextPanel

LIVE = ("waiting", "running", "preempted", "parked")  # requests that hold (or will hold) blocks
BITS = {"int8": 8, "fp8": 8, "bfloat16": 16, "float16": 16, "float32": 32}


def megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size < 10e6 else f"{size / 1e6:,.0f} MB"


def memory_text(snapshot: KVSnapshot) -> Text:
    """The cache's dtype, a block's bytes and the pool's, and the weights beside them; empty where the
    snapshot does not say (an older server's)."""
    text = Text()
    if snapshot.bytes_per_block:
        text.append(f"KV {snapshot.kv_cache_dtype} · {snapshot.bytes_per_block:,} B/block · "
                    f"pool {megabytes(snapshot.num_blocks * snapshot.bytes_per_block)}\n")
    if snapshot.weights_bytes:
        mapped = " mapped" if "GGUF" in snapshot.weights_format else ""
        text.append(f"weights {snapshot.weights_format} {megabytes(snapshot.weights_bytes)}{mapped}\n")
    return text


def contiguous_blocks(snapshot: KVSnapshot) -> int:
    """Blocks an allocator reserving each live request's max length up front would hold now."""
    size = snapshot.block_size
    return sum(-(-info.max_len // size) for info in snapshot.requests if info.status in LIVE)


def stats_text(snapshot: KVSnapshot) -> Text:
    used = snapshot.num_blocks - snapshot.num_free_blocks
    usage = 100 * used / snapshot.num_blocks if snapshot.num_blocks else 0.0
    preempted = sum(info.status == "preempted" for info in snapshot.requests)
    hits = (100 * snapshot.prefix_cache_hits / snapshot.prefix_cache_queries
            if snapshot.prefix_cache_queries else 0.0)
    contiguous = contiguous_blocks(snapshot)
    text = memory_text(snapshot)
    text.append(f"free {snapshot.num_free_blocks}/{snapshot.num_blocks} blocks", style="bold")
    text.append(f" · {usage:.0f}% used · {snapshot.num_cached_blocks} cached\n")
    text.append(f"run {snapshot.num_running} · wait {snapshot.num_waiting} · preempted {preempted} "
                f"({snapshot.num_preemptions} total) · parked {snapshot.num_parked}\n")
    text.append(f"prefix hits {hits:.0f}% · {snapshot.tokens_per_second:.1f} tok/s · step {snapshot.step}\n")
    text.append(f"contiguous would hold {contiguous:>5} blocks")
    if contiguous > snapshot.num_blocks:
        text.append(" > pool!", style="bold")
    text.append(f"\npaging holds          {used:>5} blocks", style="bold")
    if snapshot.other_num_blocks:
        text.append(f"\nat {BITS[snapshot.other_kv_cache_dtype]} bits this pool would be "
                    f"{snapshot.other_num_blocks} blocks")
    return text


class KVStats(TextPanel):
    """`free N/M blocks` and the numbers beside it."""

    DEFAULT_CSS = """
    KVStats {
        height: auto;
        padding: 0 1;
    }
    """

    def show(self, snapshot: KVSnapshot) -> None:
        self.set_text(stats_text(snapshot))
