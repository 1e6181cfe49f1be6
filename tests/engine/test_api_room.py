"""The engine's `api` room holds the types a client of a server needs (attach/ imports them): they must load
without torch, so that attaching starts fast on a machine without the model."""

import subprocess
import sys

from pagedchat.engine import api

API_MODULES = ["errors", "outputs", "params", "snapshot"]


def test_the_api_room_is_these_modules():
    from pathlib import Path

    assert sorted(p.stem for p in Path(api.__file__).parent.glob("*.py") if p.stem != "__init__") == API_MODULES


def test_the_api_room_imports_no_torch():
    imports = "; ".join(f"import pagedchat.engine.api.{name}" for name in API_MODULES)
    done = subprocess.run([sys.executable, "-c", f"{imports}; import sys; print('torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
