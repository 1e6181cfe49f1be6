"""Shared by the tests of several modules."""

from pagedchat import SamplingParams
from pagedchat.tui.app import PagedChatApp
from pagedchat.tui.loading_screen import LoadingScreen
from pagedchat.tui.message_box import MessageBox
from support.tui import wait_until

SIZE = (160, 50)


# ignore_eos: the random model may end a reply at once; these replies must run long enough to watch.
SHORT = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


LONG = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)


async def loaded(pilot) -> PagedChatApp:
    app = pilot.app
    # The loading screen closes, then the first tab opens.
    await wait_until(pilot, lambda: app.current_pane is not None and not isinstance(app.screen, LoadingScreen)
                     and app.current_pane.query(MessageBox), what="the model to load and the first tab to open")
    return app


async def reply_done(pilot, *panes) -> None:
    await wait_until(pilot, lambda: not any(p.replying for p in panes) and all(p.conversation.last_reply for p in panes),
                     what="the replies")


def notices(app: PagedChatApp, title: str | None = None) -> list[str]:
    """The app's notices with this title; by default all but the kernel plan's, which every load shows."""
    return [n.message for n in app._notifications
            if (n.title == title if title is not None else n.title != "kernel plan")]
