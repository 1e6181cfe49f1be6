"""`pagedchat --demo [SCENE]`, or the palette's "Demo: start/stop": tabs that chat by themselves."""

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from pagedchat.tui.demo import PROMPTS, SCENES, SYSTEM_PROMPT, demo_scripts

if TYPE_CHECKING:
    from pagedchat.tui.app import PagedChatApp

TICK_S = 1.0


class DemoDriver:
    """Opens the scene's tabs and, each tick, sends the next question of its script to every demo tab
    that is not replying. Demo chats are not kept in the history."""

    def __init__(self, app: "PagedChatApp", scene: str | None) -> None:
        self.on = scene is not None
        self._app = app
        self._scene = SCENES[scene or "chat"]  # the palette starts "chat"
        self._scripts = demo_scripts()
        self._tabs: dict[str, Iterator[str]] = {}  # the demo tabs open, by key: each its script
        self._forks_due = 0  # forks the scene still makes of its first tab
        self._ticking = False

    def forget(self, key: str) -> bool:
        """The tab closes: whether it was a demo tab."""
        return self._tabs.pop(key, None) is not None

    async def toggle(self) -> None:
        if self.on:
            self.on = False
            self._app.notify("Demo stopped: the tabs finish their replies and wait.")
        else:
            await self.start()

    async def start(self) -> None:
        self.on = True
        if not self._tabs:
            for index in range(self._scene.tabs):
                await self._open_tab(index)
            self._forks_due = self._scene.forks
        if not self._ticking:
            self._ticking = True
            self._app.set_interval(TICK_S, self._tick)

    async def _open_tab(self, index: int = 0) -> None:
        scene = self._scene
        prompt = SYSTEM_PROMPT if scene.shared_prompt else PROMPTS[index % len(PROMPTS)]
        params = replace(scene.params, n=scene.samples) if index == scene.tabs - 1 else scene.params
        conversation, title = self._app.tabs.new_conversation(prompt, params)
        self._tabs[conversation.key] = next(self._scripts)
        await self._app.tabs.open(conversation, f"demo {title.split()[-1]}", record=False)

    async def _fork_first(self, key: str) -> None:
        """The sharing scene: forks of the first tab, which go on with questions of their own."""
        for _ in range(self._forks_due):
            if (fork := await self._app.tabs.fork(self._app.panes[key])) is not None:
                self._tabs[fork.id] = next(self._scripts)
        self._forks_due = 0

    async def _tick(self) -> None:
        if not self.on:
            return
        first = next(iter(self._tabs), None)
        if self._forks_due and first is not None and self._app.panes[first].conversation.last_reply is not None:
            await self._fork_first(first)
        for key, script in list(self._tabs.items()):
            pane = self._app.panes[key]
            if pane.full:  # the conversation filled the context: start over in a fresh tab
                await self._app.tabs.close(pane)
                await self._open_tab()
            elif not pane.replying:
                pane.send(next(script))
