"""Issue 33 in the panel: the cache's dtype and bytes, what the same bytes hold in the other width, the weights
beside the pool, and an 8-bit block's scales in the block detail."""

import dataclasses

from support.tui import PanelApp, async_test, make_snapshot

from pagedchat.tui.block_detail import BlockDetail
from pagedchat.tui.block_grid import BlockGrid
from pagedchat.tui.kv_panel import KVPanel
from pagedchat.tui.kv_stats import stats_text

SIZE = (60, 44)

# The default model's numbers: 30 layers x 3 KV heads of 64 in 16-slot blocks; int8 rows of 64 + 4 bytes.
INT8 = dataclasses.replace(
    make_snapshot(num_blocks=150, tables={"a.1": [0, 1, 2, 3], "b.1": [4, 5]}, fills={3: 5, 5: 12}),
    kv_cache_dtype="int8", bytes_per_block=2 * 30 * 16 * 3 * 68, other_kv_cache_dtype="bfloat16",
    other_num_blocks=150 * 68 // 128, weights_format="Q4_1 GGUF", weights_bytes=98_235_712)
SCALES = {3: ((0.0123, 0.0941), (0.00402, 0.0312))}


class ScalesPanelApp(PanelApp):
    """The panel over INT8, with a local engine's scales for block 3 (the others hold none)."""

    def on_mount(self) -> None:
        self.query_one(KVPanel).show(self.snapshot, decode=lambda ids: bytes(ids).decode(errors="replace"),
                                     scales=lambda block_id, num_tokens: SCALES.get(block_id))


def test_the_header_says_the_cache_dtype_its_bytes_the_other_width_and_the_weights():
    text = stats_text(INT8).plain
    assert text.splitlines()[:2] == ["KV int8 · 195,840 B/block · pool 29 MB", "weights Q4_1 GGUF 98 MB mapped"]
    assert "at 16 bits this pool would be 79 blocks" in text
    bf16 = dataclasses.replace(INT8, kv_cache_dtype="bfloat16", bytes_per_block=2 * 30 * 16 * 3 * 128,
                               other_kv_cache_dtype="int8", other_num_blocks=282, weights_format="bf16",
                               weights_bytes=269_060_736)
    text = stats_text(bf16).plain
    assert text.splitlines()[:2] == ["KV bfloat16 · 368,640 B/block · pool 55 MB", "weights bf16 269 MB"]
    assert "at 8 bits this pool would be 282 blocks" in text


def test_a_snapshot_that_does_not_say_shows_no_memory_lines():
    text = stats_text(make_snapshot()).plain  # an older server's: no dtype, no bytes
    assert "KV " not in text and "weights" not in text and "bits this pool" not in text


def test_8_bit_pool_picture(snap_compare):
    async def select_block(pilot):
        await pilot.pause()
        pilot.app.query_one(BlockGrid).cursor = 3
        await pilot.pause()

    assert snap_compare(ScalesPanelApp(INT8), terminal_size=SIZE, run_before=select_block)


@async_test
async def test_the_block_detail_shows_an_8_bit_blocks_scales():
    async with ScalesPanelApp(INT8).run_test(size=SIZE) as pilot:
        grid = pilot.app.query_one(BlockGrid)
        await pilot.click(BlockGrid, offset=grid.cell_offset(3))
        await pilot.pause()
        detail = str(pilot.app.query_one(BlockDetail).render())
        assert "scales: K 0.0123–0.0941 · V 0.00402–0.0312" in detail
        await pilot.press("right")  # block 4: no scales given
        assert "scales" not in str(pilot.app.query_one(BlockDetail).render())
