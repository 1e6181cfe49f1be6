"""pagedchat: a terminal chat app on a paged-KV LLM engine."""

from pathlib import Path

from pagedchat.engine.api.params import SamplingParams

# Installed, `kernels/` and `themes/` are the subpackages pagedchat.kernels and pagedchat.themes
# (pyproject's package-dir). Run from a source checkout (`python -m pagedchat` in the repo root),
# this folder shadows the installed package: let it find the two folders beside it the same way.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "kernels" / "__init__.py").is_file():
    __path__.append(str(_checkout))

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; `pagedchat --help` should not wait for them.
    if name == "LLM":
        from pagedchat.engine.llm import LLM

        return LLM
    raise AttributeError(name)
