"""Fixtures for the inference tests (helpers live in inference_helpers.py)."""

import pytest
import torch
from inference_helpers import make_model


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    lengths = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33]  # across block boundaries of 4 and 16
    ps = [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]
    shared = torch.randint(0, 97, (18,), generator=g).tolist()
    ps += [shared + [1, 2, 3], shared + [4], shared, shared[:12] + [50, 60]]  # shared prefixes
    return ps


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are dominated by per-op overhead; one intra-op thread avoids oversubscribing a
    shared 2-core machine. Restored after each module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
