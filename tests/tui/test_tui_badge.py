"""Teaching mode on screen (issue 16): a paused or slowed engine says so until it runs normally again."""

from support.app import SIZE, loaded
from support.tui import async_test, wait_until
from textual.widgets._footer import FooterKey

from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.engine_badge import EngineBadge


def badge(app: PagedChatApp) -> str:
    """The badge's text as drawn, "" when no badge is on screen."""
    badge = app.screen.query_one(EngineBadge)
    return str(badge.render()) if badge.display else ""


def footer(app: PagedChatApp) -> list[str]:
    return [key.description for key in app.screen.query(FooterKey)]


@async_test
async def test_pause_and_slow_motion_show_until_undone(make_app):
    async with make_app().run_test(size=SIZE) as pilot:
        app = await loaded(pilot)
        await wait_until(pilot, lambda: "Pause" in footer(app), what="the footer's Pause")
        assert badge(app) == "" and "Resume" not in footer(app)

        await pilot.press("f5")
        await wait_until(pilot, lambda: "PAUSED" in badge(app) and "Resume" in footer(app),
                         what="the PAUSED badge and Resume in the footer")
        assert app.worker.paused and "Pause" not in footer(app)
        await pilot.pause(0.5)  # the toast may fade; the badge stays
        assert "PAUSED" in badge(app)

        await pilot.press("f5")
        await wait_until(pilot, lambda: badge(app) == "" and "Pause" in footer(app),
                         what="the badge gone and Pause back in the footer")
        assert not app.worker.paused and "Resume" not in footer(app)

        await pilot.press("f3")  # slow motion: 0.25 s a step
        await wait_until(pilot, lambda: "SLOW MOTION" in badge(app), what="the SLOW MOTION badge")
        assert "0.25" in badge(app) and "PAUSED" not in badge(app)
        await pilot.press("f5")
        await wait_until(pilot, lambda: "PAUSED" in badge(app), what="PAUSED with slow motion")
        assert "SLOW MOTION 0.25" in badge(app)
        await pilot.press("f3")  # 1 s a step
        await wait_until(pilot, lambda: "SLOW MOTION 1 " in badge(app) + " ", what="the new rate")
        await pilot.press("f3", "f5")  # slow motion off, resumed
        await wait_until(pilot, lambda: badge(app) == "" and "Pause" in footer(app), what="no badge")
        assert app.worker.delay == 0.0 and not app.worker.paused
