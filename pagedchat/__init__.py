"""pagedchat: a terminal chat app on a paged-KV LLM engine."""

import sys
from pathlib import Path

from pagedchat.engine.api.params import SamplingParams

# Installed, `kernels/` and `themes/` are the subpackages pagedchat.kernels and pagedchat.themes
# (pyproject's package-dir). Run from a source checkout (`python -m pagedchat` in the repo root),
# this folder shadows the installed package: let it find the two folders beside it the same way.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "kernels" / "__init__.py").is_file():
    __path__.append(str(_checkout))
    # On sys.path (`python -m` run in the root), the checkout also makes its kernels/ the top-level module
    # `kernels`: the name of Hugging Face's package, which transformers 5 requires and imports with its model
    # code. The root goes last, so that an installed package of that name comes first.
    _root = [entry for entry in sys.path if Path(entry or ".").resolve() == _checkout]
    sys.path[:] = [entry for entry in sys.path if entry not in _root] + _root

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; `pagedchat --help` should not wait for them.
    if name == "LLM":
        from pagedchat.engine.llm import LLM

        return LLM
    raise AttributeError(name)
