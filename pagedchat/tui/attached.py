"""Attach mode (`pagedchat --attach URL`): the app's tabs and KV panel against a server's engine.

Against vLLM the panel is the logical view (`LogicalPanel`); against `pagedchat serve` it is the local
app's own grid, drawn from the server's snapshot with the tabs' requests renamed to the tabs' ids.
"""

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pagedchat.attach.client import ApiClient, ApiError, ServerInfo
from pagedchat.attach.watch import GridWatch, LogicalSnapshot, LogicalWatch
from pagedchat.engine.api.snapshot import KVSnapshot
from pagedchat.tui.conversation import Conversation
from pagedchat.tui.logical_panel import LogicalPanel
from pagedchat.tui.remote_chat import RemoteChat
from pagedchat.tui.themes import SessionTag

FETCHING = "(fetching its text from the server…)"


@dataclass(frozen=True, slots=True)
class AttachTarget:
    url: str
    api_key: str | None = None
    kv_events: tuple[str, str | None] | None = None  # rank 0's publisher and replay endpoints
    dp_size: int | None = None  # None: as many ranks as the server's metrics name


class Attached:
    """The app's source (`pagedchat.tui.source.Source`) when attached: the tabs' backend, the watch behind
    the panel, and block texts. `on_text` is told when a block's text fetched from the server arrives."""

    moves_on_its_own = True  # the server's other clients move its engine
    teaching = None  # its engine runs on its own
    worker = None

    def __init__(self, target: AttachTarget, on_text: Callable[[], None]) -> None:
        self.target = target
        self.loading = (target.url, "connecting to")
        self.client = ApiClient(target.url, target.api_key)
        self.info: ServerInfo | None = None
        self.chat: RemoteChat | None = None
        self._watch: GridWatch | LogicalWatch | None = None
        self._renamed: tuple[KVSnapshot, KVSnapshot] | None = None  # the server's snapshot and ours
        self._texts: dict[tuple[int, ...], str] = {}
        self._fetches: set[asyncio.Task] = set()
        self._on_text = on_text

    @property
    def attached(self) -> "Attached":
        return self

    async def open(self) -> None:
        """Raises ApiError, one line, if the server is not there or refuses."""
        self.info = await self.client.info()
        self.chat = RemoteChat(self.client, self.info.max_model_len)
        if self.grid:
            self._watch = GridWatch(self.client)
        else:
            self._watch = LogicalWatch(self.client, self.contexts, self.target.kv_events, self.target.dp_size)
        self._watch.start()

    @property
    def grid(self) -> bool:
        """Whether the server publishes its blocks (`pagedchat serve`): then the real grid is drawn."""
        return self.info is not None and self.info.kind == "pagedchat"

    def panel(self) -> LogicalPanel | None:
        """The logical view where the server publishes no blocks (vLLM); else the app's KV panel."""
        return None if self.grid else LogicalPanel(self.client.detokenize, id="panel")

    def draw(self, panel, snapshot: KVSnapshot | LogicalSnapshot, tag_of: Callable[[str], SessionTag]) -> None:
        if self.grid:
            panel.show(snapshot, tag_of, self.decode)
        else:
            panel.show(snapshot, self.contexts(), tag_of)

    def num_tokens(self, conversation: Conversation) -> int:
        """The server's count of the conversation's tokens: it applies the chat template itself."""
        return self.chat.num_tokens(conversation.request_id)

    def contexts(self) -> dict[str, list[int]]:
        return self.chat.contexts if self.chat else {}

    @property
    def snapshot(self) -> KVSnapshot | LogicalSnapshot | None:
        if not isinstance(self._watch, GridWatch):
            return self._watch.snapshot if self._watch else None
        server = self._watch.snapshot
        if server is None:
            return None
        if self._renamed is None or self._renamed[0] is not server:
            self._renamed = (server, renamed(server, self.chat.server_ids))
        return self._renamed[1]

    def decode(self, token_ids: Sequence[int]) -> str:
        """A block's text for the grid's detail line: fetched once from /detokenize, shown when it comes."""
        key = tuple(token_ids)
        if key not in self._texts:
            self._texts[key] = FETCHING
            task = asyncio.get_running_loop().create_task(self._fetch_text(key))
            self._fetches.add(task)
            task.add_done_callback(self._fetches.discard)
        return self._texts[key]

    async def _fetch_text(self, key: tuple[int, ...]) -> None:
        try:
            text = await self.client.detokenize(key)
        except ApiError as exc:
            self._texts[key] = f"(its text could not be fetched: {exc})"
            self._on_text()
            del self._texts[key]  # shown once; asked again when the block is chosen again
            return
        self._texts[key] = text
        self._on_text()

    async def close(self) -> None:
        for task in self._fetches:
            task.cancel()
        if self.chat is not None:
            await self.chat.stop()
        if self._watch is not None:
            await self._watch.stop()
        await self.client.aclose()


def renamed(snapshot: KVSnapshot, ours: Mapping[str, str]) -> KVSnapshot:
    """The snapshot with the server's ids of our requests replaced by ours (the tabs' own names)."""
    def name(request_id: str | None) -> str | None:
        return ours.get(request_id, request_id)  # a tab asks for one sample: its seq id is its request id

    return dataclasses.replace(
        snapshot,
        blocks=tuple(dataclasses.replace(block, owners=tuple(map(name, block.owners))) for block in snapshot.blocks),
        requests=tuple(dataclasses.replace(info, request_id=name(info.request_id), seq_id=name(info.seq_id))
                       for info in snapshot.requests),
        block_tables={name(key): table for key, table in snapshot.block_tables.items()},
        events=tuple(dataclasses.replace(event, request_id=name(event.request_id)) for event in snapshot.events),
    )
