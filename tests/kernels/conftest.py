"""Fixtures of the kernel tests."""

import pytest
import torch


@pytest.fixture
def threads():
    """Sets torch's thread count (the one the C kernels are called with) for the test, then restores it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
