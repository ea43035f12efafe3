"""Kernel tests run on CPU: Triton kernels under TRITON_INTERPRET=1 (set before triton is imported)."""

import os
import sys

# Triton decides at import time whether it interprets; tests/conftest.py sets the variable before
# anything imports triton. If triton was imported without it anyway, the interpreter tests fail.
TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton` in this process

import pytest  # noqa: E402
import torch  # noqa: E402
from kernel_refs import check_against_reference  # noqa: E402


def pytest_configure(config):
    # Triton 3.7 marks tl.make_block_ptr deprecated in favour of tensor descriptors; the seed teaches
    # block pointers and they still work, so the warning is not news in every test. The interpreter's
    # log2(0) for rows that see no key (L = -inf by design) is not news either.
    config.addinivalue_line("filterwarnings", "ignore:tl.make_block_ptr is deprecated")
    config.addinivalue_line(
        "filterwarnings", "ignore:divide by zero encountered in log2:RuntimeWarning"
    )


@pytest.fixture(autouse=True)
def _one_thread():
    """Two shared cores: one intra-op thread avoids OpenMP oversubscription stalls (restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def triton_interpreter():
    pytest.importorskip("triton")  # a test dependency on linux x86_64 only
    if TRITON_PREIMPORTED or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail(
            "triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it first); "
            "the interpreter run of the Triton kernels did not happen"
        )


@pytest.fixture
def check():
    return check_against_reference
