"""Fixtures of the app's tests."""

import threading

import pytest
from support.app import SHORT

from pagedchat import LLM, SamplingParams
from pagedchat.tui.app import PagedChatApp


@pytest.fixture
def make_app(tiny_model):
    def make(params: SamplingParams = SHORT, gate: threading.Event | None = None, **llm_kwargs) -> PagedChatApp:
        """`gate`: the loading waits for it, so a test can act while the loading screen is up."""
        kwargs = dict(dtype="float32", device="cpu", attention_backend="torch", num_kv_blocks=96) | llm_kwargs

        def load() -> LLM:
            if gate is not None:
                gate.wait(60)
            return LLM(model=tiny_model, **kwargs)

        return PagedChatApp(load, params=params)

    return make
