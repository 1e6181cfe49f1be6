"""What one block holds: id, ref count, owners, hash and the text of its tokens."""

from collections.abc import Callable

from rich.text import Text
from textual.widgets import Static

from pagedchat.engine.api.snapshot import BlockInfo
from pagedchat.tui.themes import SessionTag

HINT = "click a block, or focus the grid (tab) and use the arrow keys, to see what it holds"


Scales = tuple[tuple[float, float], tuple[float, float]]  # an 8-bit block's (keys, values) scales: (min, max)


def detail_text(block: BlockInfo, block_size: int, tag_of: Callable[[str], SessionTag], tokens_text: str,
                scales: Scales | None = None) -> Text:
    state = "free" if block.ref_count == 0 else "shared" if block.ref_count > 1 else "in use"
    if block.ref_count == 0 and block.cached:
        state = "free, cached prefix"
    text = Text()
    text.append(f"block {block.block_id}", style="bold")
    text.append(f" · ref {block.ref_count} · {block.num_tokens}/{block_size} tokens · {state}\n")
    owners = ", ".join(tag_of(owner).name for owner in block.owners) or "none"
    text.append(f"owners: {owners}\n")
    text.append(f"hash: {block.block_hash:016x}\n" if block.block_hash is not None else "hash: none (not full)\n")
    if scales is not None:  # an 8-bit cache's: each slot's KV head in every layer has its own
        (k_low, k_high), (v_low, v_high) = scales
        text.append(f"scales: K {k_low:.3g}–{k_high:.3g} · V {v_low:.3g}–{v_high:.3g}\n")
    text.append(repr(tokens_text) if block.token_ids else "(empty)", style="italic")
    return text


class BlockDetail(Static):
    DEFAULT_CSS = """
    BlockDetail {
        height: auto;
        max-height: 8;
        padding: 0 1;
        border-top: hkey $panel;
    }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(HINT, classes="-hint", **kwargs)
        self._key: tuple | None = None

    def show(self, block: BlockInfo | None, block_size: int, tag_of: Callable[[str], SessionTag],
             decode: Callable[[list[int]], str], scales: Scales | None = None) -> None:
        # The text is part of the key: an attached server's arrives a moment after the block is chosen.
        tokens_text = decode(list(block.token_ids)) if block is not None and block.token_ids else ""
        key = None if block is None else (block, tuple(tag_of(owner) for owner in block.owners), tokens_text,
                                          scales)
        if key != self._key:
            self._key = key
            self.update(HINT if block is None else detail_text(block, block_size, tag_of, tokens_text, scales))
            self.set_class(block is None, "-hint")  # a short screen hides the hint (app.tcss)
