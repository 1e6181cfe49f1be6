"""Helpers for the TUI tests (no tests here): hand-made snapshots, a frozen engine, waiting in Pilot."""

import asyncio
import functools
import time
from types import SimpleNamespace

from support.models import byte_tokenizer
from textual.app import App, ComposeResult
from textual.geometry import Region

from pagedchat.engine.api.snapshot import BlockEvent, BlockInfo, KVSnapshot, RequestInfo
from pagedchat.tui.kv_panel import KVPanel
from pagedchat.tui.themes import DEFAULT_THEME, load_themes


def make_snapshot(num_blocks: int = 64, block_size: int = 16, tables: dict | None = None,
                  fills: dict | None = None, cached: tuple = (), statuses: dict | None = None,
                  events: tuple = (), step: int = 7, max_len: int = 1024, preemptions: int = 0,
                  stepped: dict | None = None) -> KVSnapshot:
    """A consistent snapshot: owners and ref counts follow the block tables; a block is full unless
    `fills` says otherwise; `cached` blocks are free but keep a hash. `stepped` maps the
    requests the last step ran to their computed tokens (before it, after it); the others computed none."""
    tables = tables or {}
    owners: dict[int, list[str]] = {}
    for request_id, table in tables.items():
        for block_id in table:
            owners.setdefault(block_id, []).append(request_id)
    blocks = []
    for block_id in range(num_blocks):
        held = tuple(owners.get(block_id, ()))
        filled = (fills or {}).get(block_id, block_size if held or block_id in cached else 0)
        full = filled == block_size
        blocks.append(BlockInfo(block_id, len(held), filled, held, not held and block_id in cached,
                                0x9E3779B97F4A7C15 ^ block_id if full else None,
                                tuple(range(97, 97 + filled))))
    statuses, stepped = statuses or {}, stepped or {}
    requests = tuple(
        RequestInfo(rid, rid, statuses.get(rid, "running"), tuple(table), sum(blocks[b].num_tokens for b in table),
                    stepped.get(rid, (0, 0))[1], 0, max_len, stepped.get(rid, (0, 0))[0])
        for rid, table in tables.items())
    return KVSnapshot(
        step=step, num_blocks=num_blocks, block_size=block_size,
        num_free_blocks=sum(b.ref_count == 0 for b in blocks), num_cached_blocks=sum(b.cached for b in blocks),
        blocks=tuple(blocks), requests=requests, block_tables={r.request_id: r.block_table for r in requests},
        num_running=sum(r.status == "running" for r in requests),
        num_waiting=sum(r.status in ("waiting", "preempted") for r in requests),
        num_parked=sum(r.status == "parked" for r in requests), num_preemptions=preemptions,
        prefix_cache_queries=120, prefix_cache_hits=48, tokens_per_second=31.5, events=tuple(events))


def events(*specs: tuple) -> tuple[BlockEvent, ...]:
    """BlockEvents from (step, kind, block_id, request_id) tuples, numbered in order."""
    return tuple(BlockEvent(seq, *spec) for seq, spec in enumerate(specs))


class PanelApp(App):
    """The KV panel alone, drawing one hand-made snapshot."""

    def __init__(self, snapshot: KVSnapshot, theme: str = DEFAULT_THEME) -> None:
        super().__init__()
        self.snapshot = snapshot
        for theme_obj in load_themes().values():
            self.register_theme(theme_obj)
        self.theme = theme

    def compose(self) -> ComposeResult:
        yield KVPanel()

    def on_mount(self) -> None:
        self.query_one(KVPanel).show(self.snapshot, decode=lambda ids: bytes(ids).decode(errors="replace"))


class FrozenEngine:
    """An engine that never has work and always shows one snapshot: an app with nothing live."""

    def __init__(self, snapshot: KVSnapshot) -> None:
        self.snapshot = snapshot
        self.config = SimpleNamespace(max_model_len=1024)

    def kv_snapshot(self) -> KVSnapshot:
        return self.snapshot

    def has_unfinished_requests(self) -> bool:
        return False


def frozen_llm(snapshot: KVSnapshot):
    tokenizer = byte_tokenizer()
    return lambda: SimpleNamespace(engine=FrozenEngine(snapshot), get_tokenizer=lambda: tokenizer)


async def wait_until(pilot, condition, timeout: float = 30.0, what: str = "condition") -> None:
    """Let the app run until `condition()` holds; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        # Not pilot.pause: it waits for every widget to drain its queue, which a streaming reply
        # keeps full, so one pause can last the whole reply.
        await asyncio.sleep(0.02)


def async_test(test):
    """Run an async test function on its own event loop (the project has no async pytest plugin)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


def screen_text(app: App, region: Region | None = None) -> list[str]:
    """The screen as a person reads it, one string per row (what tmux's capture-pane gives); with a region,
    its rows cut to its columns. The cut is by cells: a reply's combining characters or wide ones make a
    row's string index differ from its column."""
    strips = app.screen._compositor.render_strips()
    if region is None:
        return [strip.text for strip in strips]
    return [strip.crop(region.x, region.right).text for strip in strips[region.y:region.bottom]]
