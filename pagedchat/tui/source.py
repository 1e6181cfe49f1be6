"""Where the app's tabs chat and what its panel draws: the local engine, or a server it attached to
(`pagedchat.tui.attached.Attached`). The app calls either through `Source` without asking which it has."""

import copy
import gc
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from textual.widget import Widget

from pagedchat.engine.api.snapshot import KVSnapshot
from pagedchat.engine.runtime.engine_thread import EngineThread
from pagedchat.engine.runtime.own_thread import in_own_thread
from pagedchat.tui.chat_backend import ChatBackend, LocalChat
from pagedchat.tui.conversation import Conversation
from pagedchat.tui.themes import SessionTag

if TYPE_CHECKING:
    from pagedchat.attach.watch import LogicalSnapshot
    from pagedchat.tui.attached import Attached


class Teaching(Protocol):
    """Teaching mode's controls: the local engine thread's (`EngineThread`)."""

    paused: bool
    delay: float  # seconds between steps

    def set_paused(self, paused: bool) -> None: ...
    def step_once(self) -> None: ...
    def set_delay(self, delay: float) -> None: ...


class Source(Protocol):
    """Called on the UI thread."""

    loading: tuple[str, str]  # what the loading screen names, and what it is doing ("loading", ...)
    chat: ChatBackend | None  # what the tabs chat with, once open
    teaching: Teaching | None  # pause, step and slow motion, where the source has them
    moves_on_its_own: bool  # its snapshots change without a command from this app (a server's other clients)
    worker: EngineThread | None  # the local engine's thread, else None: for `serve --tui` and tests
    attached: "Attached | None"  # the server's connection, else None: for tests

    async def open(self) -> None: ...  # load or connect; raises, and the app says why in one line
    @property
    def snapshot(self) -> "KVSnapshot | LogicalSnapshot | None": ...
    def decode(self, token_ids: Sequence[int]) -> str: ...
    def num_tokens(self, conversation: Conversation) -> int: ...
    def panel(self) -> Widget | None: ...  # once open: a panel of its own in place of the KV panel
    def draw(self, panel: Widget, snapshot, tag_of: Callable[[str], SessionTag]) -> None: ...
    async def close(self) -> None: ...


class LocalEngine:
    """The app's own engine: `load_llm` builds the `LLM` in a thread after the screen opens, and one
    engine thread runs it. `on_command` is told (from any thread) when a command is on its way to the
    engine; `on_engine(llm, worker)` once the engine thread runs (`serve --tui` serves it too)."""

    moves_on_its_own = False
    attached = None

    def __init__(self, load_llm: Callable[[], object], model_name: str, on_command: Callable[[], None],
                 on_engine: Callable[[object, EngineThread], None] | None = None,
                 notify: Callable[..., None] | None = None) -> None:
        self.loading = (model_name, "loading")
        self.chat: LocalChat | None = None
        self.engine = None  # the LLMEngine, the thread's alone once it runs: tests touch it only while it idles
        self.worker: EngineThread | None = None
        self.tokenizer = None  # the UI thread's own: the engine thread decodes with the engine's
        self._load_llm = load_llm
        self._on_command = on_command
        self._on_engine = on_engine
        self._notify = notify

    async def open(self) -> None:
        # The loading runs in a thread and the result comes back here by await, not by
        # call_from_thread, which would block the thread forever if the app quit meanwhile.
        llm, self.tokenizer = await in_own_thread(self._load_with_tokenizer)
        # The model, torch and transformers leave ~450,000 objects that live as long as the app.
        # Textual's garbage soon triggers a full collection, which walks them all (~220 ms here) in
        # whichever thread it hits, the engine's included: freeze them out of every collection (after
        # one last collection, so that the loading's own garbage is not frozen with them).
        gc.collect()
        gc.freeze()
        self.engine = llm.engine
        self.worker = EngineThread(self.engine, on_command=self._on_command)
        self.worker.start()
        pool = self.worker.snapshot
        self.chat = LocalChat(self.worker, self.tokenizer, self.engine.config.max_model_len,
                              pool.num_blocks * pool.block_size)
        # which products and attention run here, and any C kernel that could not be built, with why
        plan = getattr(getattr(self.engine, "runner", None), "plan", None)  # None: a stand-in engine (tests)
        if self._notify is not None and plan is not None:
            self._notify(plan.describe(), title="kernel plan", severity="warning" if plan.problems else "information")
        if self._on_engine is not None:
            self._on_engine(llm, self.worker)

    def _load_with_tokenizer(self) -> tuple[object, object]:
        """The LLM, and the UI thread's own copy of its tokenizer: fast tokenizers are not thread-safe."""
        llm = self._load_llm()
        return llm, copy.deepcopy(llm.get_tokenizer())

    @property
    def teaching(self) -> EngineThread | None:
        return self.worker

    @property
    def snapshot(self) -> KVSnapshot | None:
        return self.worker.snapshot if self.worker else None

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def num_tokens(self, conversation: Conversation) -> int:
        return conversation.num_tokens

    def panel(self) -> None:
        return None

    def draw(self, panel, snapshot: KVSnapshot, tag_of: Callable[[str], SessionTag]) -> None:
        panel.show(snapshot, tag_of, self.decode, getattr(self.engine, "block_scales", None))  # None: a stand-in

    async def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()
