"""Issue 32, items 3, 4, 5 and 10: a reply's line breaks on screen, the engine's state in one place that
always shows, the last turn's line whole, and the app at 80x24."""

import random
import re

import pytest
from support.app import LONG, loaded, reply_done
from support.tui import async_test, screen_text, wait_until
from textual.app import App, ComposeResult
from textual.widget import Widget
from textual.widgets import Static

from pagedchat.engine.api.snapshot import BlockEvent
from pagedchat.tui.block_tables import BlockTables
from pagedchat.tui.chat_message import ChatMessage
from pagedchat.tui.event_log import MAX_IDS, EventLog
from pagedchat.tui.kv_panel import KVPanel
from pagedchat.tui.kv_stats import KVStats
from pagedchat.tui.text_panel import flow
from pagedchat.tui.themes import SessionTag

POEM = "The sea is wide,\nthe sea is deep;\nit sings all night\nand rocks to sleep."
REPLY = POEM + "\n\n- salt\n- foam\n\n```python\ndef tide():\n    return 2\n```"


class Messages(App):
    def compose(self) -> ComposeResult:
        yield ChatMessage("assistant", REPLY)
        yield ChatMessage("assistant")


def rows_holding(rows: list[str], *texts: str) -> list[int]:
    """The row each text is on (each must be on exactly one)."""
    found = [[y for y, row in enumerate(rows) if text in row] for text in texts]
    assert all(len(ys) == 1 for ys in found), (texts, rows)
    return [ys[0] for ys in found]


@async_test
async def test_a_replys_line_breaks_show_as_the_model_wrote_them_whole_or_streamed():
    app = Messages()
    async with app.run_test(size=(60, 50)) as pilot:
        streamed = app.query(ChatMessage).last()
        for piece in re.findall(r".{1,3}", REPLY, re.DOTALL):  # a few characters at a time, as tokens come
            await streamed.append(piece)
        await pilot.pause()
        rows = screen_text(app)
        first, second = app.query(ChatMessage)
        for message in (first, second):
            mine = rows[message.region.y:message.region.bottom]
            lines = rows_holding(mine, *POEM.splitlines(), "salt", "foam", "def tide():", "return 2")
            assert lines == sorted(lines) and len(set(lines)) == len(lines)  # each on a row of its own, in order
            assert "```" not in "".join(mine)  # the code block is still drawn as one


def region_text(app: App, widget: Widget) -> str:
    """What the widget shows on screen, its rows joined by spaces."""
    return " ".join(row.strip() for row in screen_text(app, widget.content_region))


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
@async_test
async def test_the_last_turns_line_shows_whole_on_a_narrow_chat_and_a_wide_one(make_app, size):
    app = make_app(params=LONG)
    async with app.run_test(size=size) as pilot:
        pane = (await loaded(pilot)).current_pane
        assert pane.send("a question " * 12)  # three-digit counts: the line takes the chat's whole width at 160

        def reply_tokens() -> int:
            progress = pane.chat.progress(pane.conversation.request_id)
            return len(progress.outputs[0].token_ids) if progress else 0

        await wait_until(pilot, lambda: reply_tokens() >= 100, what="a hundred tokens of the reply")
        await pilot.press("escape")
        await reply_done(pilot, pane)
        info = pane.query_one("#turn-info", Static)
        await wait_until(pilot, lambda: region_text(app, info) == str(info.content), what="the whole line on screen")
        assert str(info.content).startswith("last turn: prompt") and str(info.content).endswith("· stopped")


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
@async_test
async def test_pause_and_slow_motion_show_in_a_line_of_their_own_and_every_tab_label_stays_whole(make_app, size):
    app = make_app(params=LONG)
    async with app.run_test(size=size) as pilot:
        await loaded(pilot)
        for _ in range(2):
            await app.action_new_chat()
        for pane in app.panes.values():
            assert pane.send("hello")
        await wait_until(pilot, lambda: all(pane.reply_text for pane in app.panes.values()), what="three replies")
        await pilot.press("f5", "f3")
        bar = app.query_one("#chats ContentTabs")

        def tab_row() -> str:
            return screen_text(app)[bar.region.y]

        def labels_whole() -> bool:
            return all(app.tab_labels.shown(key) in tab_row() for key in app.panes)

        await wait_until(pilot, lambda: any("PAUSED" in row and "SLOW MOTION 0.25 s/step" in row
                                            for row in screen_text(app)), what="the engine's state on screen")
        await wait_until(pilot, labels_whole, what="every tab's label whole")
        assert "PAUSED" not in tab_row() and "SLOW" not in tab_row() and len(app.panes) == 3
        assert all("PAUSED" not in app.tab_labels.shown(key) for key in app.panes)
        await pilot.press("f4")  # the panel hidden: the state still shows
        await wait_until(pilot, lambda: not app.query_one("#panel").display, what="the panel to hide")
        assert any("PAUSED" in row for row in screen_text(app))
        await pilot.press("f3", "f3", "f5")  # full speed: the line goes
        await wait_until(pilot, lambda: not any("PAUSED" in row or "SLOW" in row for row in screen_text(app)),
                         what="the engine's state gone")


@async_test
async def test_at_80x24_the_footer_keeps_help_settings_panel_and_pause_and_the_panel_shows_whole(make_app):
    app = make_app(num_kv_blocks=512)  # the default pool's size: the grid scrolls
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        for _ in range(2):
            await app.action_new_chat()
        for pane in app.panes.values():
            assert pane.send("hello")
        await reply_done(pilot, *app.panes.values())
        panel, log, tables = app.query_one(KVPanel), app.query_one(EventLog), app.query_one(BlockTables)
        await wait_until(pilot, lambda: panel.snapshot is app.worker.snapshot and log.lines, what="the panel")
        await pilot.pause()
        rows = screen_text(app)
        assert all(key in rows[-1] for key in ("f1 Help", "f2 Settings", "f4 Panel", "f5 Pause")), rows[-1]
        on_screen = app.screen.region
        for widget in (log, tables, app.query_one(KVStats)):  # each whole on screen, above the footer
            assert on_screen.contains_region(widget.region) and widget.region.bottom <= len(rows) - 1, widget
        panel_rows = screen_text(app, panel.region)
        assert not any(row.rstrip().endswith("…") for row in panel_rows), panel_rows
        assert "allocate" in region_text(app, log)
        shown_ids = region_text(app, tables).replace(":", " ").split()
        for info in panel.snapshot.requests:  # every block id of every table
            assert all(str(block_id) in shown_ids for block_id in info.block_table), (info, shown_ids)


def test_flow_breaks_lines_only_between_words_and_keeps_every_word_in_order():
    rng = random.Random(32)
    for _ in range(200):
        width = rng.randint(8, 60)
        lines = [[("" if i == 0 else rng.choice([" · ", " ", ", "]), "x" * rng.randint(1, 12))
                  for i in range(rng.randint(1, 8))] for _ in range(rng.randint(1, 4))]
        shown = flow(lines, width, indent="  ").plain.split("\n")
        # Each line holds whole words: those of one input line, in order, its first ones unindented.
        words = [word for line in shown for word in re.split(r" · | |, ", line.strip())]
        assert words == [word for line in lines for _, word in line]
        assert sum(not line.startswith(" ") for line in shown) == len(lines)
        assert all(len(line) <= width or " " not in line.strip() for line in shown)  # too long: one word alone


def test_an_event_log_line_lists_the_ids_that_fit_and_how_many_more():
    tag = SessionTag("chat 1", 0)
    run = [BlockEvent(seq, 3, "allocate", 100 + seq, "chat-1.1") for seq in range(12)]
    for width in (25, 37, 55, None):
        text = EventLog._line(3, "allocate", "chat-1.1", run, lambda _: tag, {tag.variable: "red"}, width).plain
        ids = re.findall(r"#(\d+)", text)
        more = int(text.split(" +")[1]) if " +" in text else 0
        assert ids == [str(100 + i) for i in range(len(ids))] and len(ids) + more == 12
        if width is None:
            assert len(ids) == MAX_IDS
            continue
        assert len(text) <= width
        if len(ids) < MAX_IDS:  # one more would not have fitted
            rest = f" +{more - 1}" if more > 1 else ""
            assert len(text) - len(f" +{more}") + len(f" #{100 + len(ids)}") + len(rest) > width
