"""pagedchat: a terminal chat app on a paged-KV LLM engine."""

from pagedchat.engine.params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; `pagedchat --help` should not wait for them.
    if name == "LLM":
        from pagedchat.engine.llm import LLM

        return LLM
    raise AttributeError(name)
