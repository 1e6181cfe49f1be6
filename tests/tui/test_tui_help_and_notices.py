"""Issue 32, item 13: f1 gives f5 one row; the legend's digit reads as what it is; the palette's
screenshot saves where the export goes, with no downloads folder; a pool smaller than the model's
context is named as the limit."""

import re

from support.app import SIZE, loaded, notices
from support.tui import async_test, frozen_llm, make_snapshot, wait_until
from textual.widgets import Markdown

from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.help_screen import HelpScreen
from pagedchat.tui.kv_panel import legend_text


@async_test
async def test_f1_gives_each_key_one_row_and_f5_says_pause_or_resume():
    app = PagedChatApp(frozen_llm(make_snapshot()))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        await pilot.press("f1")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), what="the help")
        keys_table = app.screen.query_one(Markdown).source.split("## Editing keys")[0]
        keys = re.findall(r"(?m)^\| `([^`]+)` \|", keys_table)
        assert len(keys) == len(set(keys)) and "f5" in keys
        assert "| `f5` | Pause or resume |" in keys_table


def test_the_legend_says_a_digit_is_the_number_of_tables_sharing_the_block():
    colours = {name: "red" for name in ("session-0", "block-shared", "block-cached", "block-free")}
    legend = legend_text(colours).plain
    assert "2 shared by 2" in legend and "×" not in legend


@async_test
async def test_the_palettes_screenshot_goes_to_the_export_folder_when_there_is_no_downloads_folder(
        tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/Downloads
    for variable in ("XDG_DOWNLOAD_DIR", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("XDG_DOCUMENTS_DIR", str(tmp_path / "Documents"))  # missing too: made for it
    app = PagedChatApp(frozen_llm(make_snapshot()))
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot)
        [screenshot] = [c for c in app.get_system_commands(app.screen) if c.title == "Screenshot"]
        screenshot.callback()
        folder = tmp_path / "Documents" / "pagedchat"
        await wait_until(pilot, lambda: folder.is_dir() and any(folder.glob("*.svg")), what="the screenshot")
        await wait_until(pilot, lambda: any("Saved screenshot" in n for n in notices(app, "Screenshot")),
                         what="the notice that says where")
        assert not (tmp_path / "Downloads").exists()


@async_test
async def test_a_message_longer_than_a_one_block_pool_names_the_pool_not_the_models_context(make_app):
    app = make_app(num_kv_blocks=1, block_size=16)
    async with app.run_test(size=SIZE) as pilot:
        pane = (await loaded(pilot)).current_pane
        assert not pane.send("a message longer than sixteen tokens with the chat template around it")
        await wait_until(pilot, lambda: notices(app), what="the notice why")
        [notice] = notices(app)
        assert "the KV pool holds 16" in notice and "model's context" not in notice
