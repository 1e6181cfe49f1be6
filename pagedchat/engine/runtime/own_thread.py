"""Run a model's loading in a thread of its own, one that ends with it (torch-free: the attach mode's app
imports this without torch)."""

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
THREAD_NAME = "pagedchat-load"


async def in_own_thread(fn: Callable[[], T]) -> T:
    """fn() in a thread that ends with it, awaited. Loading a model runs torch ops, which give the thread
    that runs them OpenMP workers of its own; in a thread that lives on (asyncio.to_thread's) they stay,
    and beside the engine thread's they make more OpenMP threads than cores, so libgomp cuts every
    worker's spin-wait to a hundred turns: each op then waits for its workers to wake, and a batch of 16
    chats stepped 10-18% slower than with the loader's workers gone."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody awaits any more
            loop.call_soon_threadsafe(lambda: done.done() or outcome())

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side, as to_thread does
            error = exc
            settle(lambda: done.set_exception(error))
        else:
            settle(lambda: done.set_result(result))

    threading.Thread(target=run, name=THREAD_NAME, daemon=True).start()
    return await done
