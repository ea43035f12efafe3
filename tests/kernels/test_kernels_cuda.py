"""On a machine with a CUDA GPU: the compiled Triton kernels agree with the fp64 references.

The rest of tests/kernels runs the same kernels under TRITON_INTERPRET=1 (set process-wide by
the conftest), so the GPU check runs in a subprocess without it. Skipped without CUDA.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernels_on_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("kernel_cuda_check.py"))],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
