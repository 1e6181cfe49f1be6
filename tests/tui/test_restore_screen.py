"""The offer at start lists last time's chats one a line, a title too long for the dialog cut with an ellipsis."""

from support.tui import async_test
from textual.app import App
from textual.widgets import Label

from pagedchat.history import SavedChat
from pagedchat.tui.restore_screen import RestoreScreen

LONG_TITLE = "How does an operating system use virtual memory, page tables and the translation lookaside buffer"
TITLES = [LONG_TITLE, "Write a haiku", "Reverse a list", "Copy-on-write", "chat 5", "chat 6", "chat 7", "chat 8"]


def saved(titles: list[str]) -> list[SavedChat]:
    return [SavedChat(i, title, None, {}, [{"role": "user", "content": "hi"}] * (i + 1))
            for i, title in enumerate(titles)]


class OfferApp(App):
    def __init__(self, chats: list[SavedChat]) -> None:
        super().__init__()
        self.chats = chats

    def on_mount(self) -> None:
        self.push_screen(RestoreScreen(self.chats))


def shown(label: Label) -> str:
    return label.render_line(0).text.rstrip()


@async_test
async def test_each_title_shows_whole_or_ends_in_an_ellipsis_and_the_rest_are_counted():
    app = OfferApp(saved(TITLES))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        heading, *rows = app.screen.query(Label)
        assert shown(heading) == "8 chat(s) from last time (36 messages):"
        lines = [shown(row) for row in rows]
        assert lines[-1].strip() == "… and 2 more"
        first, *others = lines[:-1]
        assert first.endswith("…") and LONG_TITLE.startswith(first.removeprefix("• ").removesuffix("…"))
        assert len(first) > 40  # cut at the dialog's edge, not early
        assert others == [f"• {title}" for title in TITLES[1:6]]


@async_test
async def test_a_short_list_is_shown_whole():
    app = OfferApp(saved(["one [b]markup[/b]", "two"]))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert [shown(label) for label in app.screen.query(Label)][1:] == ["• one [b]markup[/b]", "• two"]
