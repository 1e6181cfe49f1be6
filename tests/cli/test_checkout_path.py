"""`python -m pytest` in the repo root puts the checkout first on sys.path, where its kernels/ would hide the
`kernels` package that transformers imports as it loads a model; conftest puts the checkout last. This module
imports nothing that would do it instead (bench does, as it is imported)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def test_kernels_is_not_the_checkouts():
    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.origin) != CHECKOUT / "kernels" / "__init__.py"


def test_python_m_pytest_in_the_checkout_leaves_kernels_to_the_package(tmp_path):
    """A `kernels` package on PYTHONPATH stands in for the installed one; the test above, run by `python -m
    pytest` from the checkout, must find it."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    node = f"{Path(__file__).relative_to(CHECKOUT)}::test_kernels_is_not_the_checkouts"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node], cwd=CHECKOUT,
                          env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
