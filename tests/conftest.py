"""Fixtures every area shares: tiny random models built in place, one per supported architecture."""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
os.environ.setdefault("PAGEDCHAT_COMPILE", "0")  # the tests that compile ask for it; the rest stay eager

# `bench` is importable for its smoke tests; appended, not prepended, so that `pagedchat` is still the
# installed package (whose `pagedchat.kernels` the source folder lacks).
sys.path.append(str(Path(__file__).resolve().parent.parent))

import pytest
from support.models import ARCHITECTURES, build_tiny_model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def tiny_model(tiny_models) -> Path:
    return tiny_models["llama"]
