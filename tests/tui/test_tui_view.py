"""Issue 32, items 3, 4, 5 and 10: a reply's line breaks on screen, the engine's state in one place that
always shows, the last turn's line whole, and the app at 80x24."""

import re

from support.tui import async_test, screen_text
from textual.app import App, ComposeResult

from pagedchat.tui.chat_message import ChatMessage

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
