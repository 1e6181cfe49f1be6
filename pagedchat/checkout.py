"""Running from a source checkout: `python -m pagedchat` or `python -m bench.run` in the repo root."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def put_last_on_sys_path() -> None:
    """Python put the checkout first on sys.path (`-m`, `-c`), where its kernels/ hides the `kernels` package
    that transformers (5.25 on) and vLLM import: it goes last, behind the installed packages. pagedchat finds
    its own kernels as pagedchat.kernels either way (pagedchat/__init__.py)."""
    if not (ROOT / "pyproject.toml").is_file():  # an installed pagedchat: ROOT is site-packages
        return
    entries = [entry for entry in sys.path if Path(entry or os.curdir).resolve() == ROOT]
    for entry in entries:
        sys.path.remove(entry)
    sys.path.extend(entries[:1])
