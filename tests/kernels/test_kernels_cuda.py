"""On a machine with a CUDA GPU: the compiled Triton kernels agree with the fp64 references.

The rest of tests/kernels runs the same kernels under TRITON_INTERPRET=1 (set for the whole pytest
process by tests/conftest.py, on every machine), so the GPU check runs in a subprocess without it.
Skipped without CUDA, unless LMSTACK_REQUIRE_CUDA=1 (then it fails); ``pytest -m cuda`` selects it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.slow
@pytest.mark.cuda
def test_triton_kernels_on_gpu():
    if not torch.cuda.is_available():
        if os.environ.get("LMSTACK_REQUIRE_CUDA") == "1":
            pytest.fail(
                "LMSTACK_REQUIRE_CUDA=1 but torch sees no CUDA GPU: the compiled Triton run did not happen"
            )
        pytest.skip(
            "the compiled Triton run needs a CUDA GPU (the interpreter run covers the kernels on CPU)"
        )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("kernel_cuda_check.py"))],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
