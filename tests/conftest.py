"""Fixtures every area shares: tiny random models built in place, one per supported architecture."""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
os.environ.setdefault("PAGEDCHAT_COMPILE", "0")  # the tests that compile ask for it; the rest stay eager

# `bench` is importable for its smoke tests; appended, not prepended, so that `pagedchat` is still the
# installed package (whose `pagedchat.kernels` the source folder lacks).
sys.path.append(str(Path(__file__).resolve().parent.parent))

from pagedchat.checkout import put_last_on_sys_path  # noqa: E402

put_last_on_sys_path()  # `python -m pytest` in the repo root put the checkout first, where its kernels/ hides `kernels`

import pytest  # noqa: E402
from support.models import ARCHITECTURES, build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> Path:
    return tiny_models["llama"]
