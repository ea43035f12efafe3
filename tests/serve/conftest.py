"""Fixtures for the serving tests (helpers live in serve_helpers.py)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are dominated by per-op overhead; one intra-op thread on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
