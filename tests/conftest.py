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


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: the compiled Triton run on a CUDA GPU (a subprocess)")
