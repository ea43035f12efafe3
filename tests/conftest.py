"""Suite-wide set-up. Triton kernels are tested twice, each run explicit:

- the interpreter run: this pytest process always runs Triton under ``TRITON_INTERPRET=1``, on
  CPU-only and CUDA machines alike (Triton reads the variable when it is first imported, so it is
  set here, before any test module can import it). Every tests/kernels test that needs the
  interpreter fails — it does not skip — if Triton was imported without it;
- the compiled run: on a machine with a CUDA GPU, ``tests/kernels/test_kernels_cuda.py`` runs
  ``kernel_cuda_check.py`` in a subprocess without the variable (``pytest -m cuda`` selects it;
  with ``LMSTACK_REQUIRE_CUDA=1`` a missing GPU is a failure instead of a skip).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402  (after TRITON_INTERPRET: nothing below may import triton first)
import torch  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module whose timings or small kernels suffer from the other core's load
    (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: the compiled Triton run on a CUDA GPU (a subprocess)")


# Under CI (CI=true) nothing may skip but the compiled CUDA run on a machine without a GPU: CI installs
# every optional package and file the suite uses, so any other skip means coverage was lost (a package
# renamed a module, a file moved) and fails the run instead of passing quietly.
CI_ALLOWED_SKIPS = ("needs a CUDA GPU",)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    lost = [r for r in skipped if not any(ok in _skip_reason(r) for ok in CI_ALLOWED_SKIPS)]
    if lost:
        for r in lost:
            reporter.write_line(f"CI: unexpected skip {r.nodeid}: {_skip_reason(r)}", red=True)
        session.exitstatus = 1
