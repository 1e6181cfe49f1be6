"""Issue 16: `--demo [SCENE]`. `pressure` runs a small pool dry (preemptions), `sharing` forks its first
tab once it has replied (its system prompt's blocks then shared three ways)."""

from test_tui_app import SIZE
from test_tui_support import async_test, wait_until

from pagedchat import LLM
from pagedchat.cli import build_parser
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.demo import PROMPTS, SCENES


def scene_app(tiny_model, scene: str, num_kv_blocks: int) -> PagedChatApp:
    kwargs = dict(model=tiny_model, dtype="float32", device="cpu", attention_backend="torch",
                  num_kv_blocks=num_kv_blocks, block_size=16)
    return PagedChatApp(lambda: LLM(**kwargs), demo=scene)


@async_test
async def test_the_pressure_scene_runs_its_pool_dry_and_the_engine_preempts(tiny_model):
    app = scene_app(tiny_model, "pressure", SCENES["pressure"].num_blocks)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: len(app._panes) == 6, what="six demo tabs", timeout=60)
        prompts = {pane.conversation.system_prompt for pane in app._panes.values()}
        assert prompts == set(PROMPTS)  # nothing shared: each tab's blocks are its own
        await wait_until(pilot, lambda: app.worker.snapshot.num_preemptions > 0, what="a preemption", timeout=120)


@async_test
async def test_the_sharing_scene_forks_its_first_tab_and_the_forks_share_its_blocks(tiny_model):
    app = scene_app(tiny_model, "sharing", 256)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: len(app._panes) == 3, what="two tabs and a fork", timeout=120)
        titles = sorted(pane.title for pane in app._panes.values())
        assert titles == ["demo 1", "demo 1′", "demo 2"]
        await wait_until(pilot, lambda: any(b.ref_count >= 3 for b in app.worker.snapshot.blocks),
                         what="blocks shared by the first tab and its forks", timeout=60)


def test_demo_takes_a_scene_and_defaults_to_chat():
    parser = build_parser()
    assert parser.parse_args(["--demo"]).demo == "chat"
    assert parser.parse_args(["--demo", "pressure"]).demo == "pressure"
    assert parser.parse_args([]).demo is None
