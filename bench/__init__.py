"""pagedchat's benchmarks, run from the checkout: `python -m bench.run`, `python -m bench.peers ...`."""

import os
import sys
from pathlib import Path


def _checkout_last() -> None:
    """`python -m bench.x` (or -c) puts the checkout first on sys.path, where its kernels/ hides the `kernels`
    package that transformers imports, and its pagedchat/ the installed one: once bench itself is found, the
    checkout goes last, as tests/conftest.py puts it."""
    checkout = Path(__file__).resolve().parent.parent
    entries = [entry for entry in sys.path if Path(entry or os.curdir).resolve() == checkout]
    for entry in entries:
        sys.path.remove(entry)
    sys.path.extend(entries[:1])


_checkout_last()
