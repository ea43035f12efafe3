"""The Triton kernels compile for a real GPU target (sm_90: H100/H200) on this CPU-only machine.

The interpreter never lowers a kernel, so GPU-only failures (types the compiler rejects, tiles
that need more shared memory than an SM has) would otherwise surface only on a GPU. Every
autotuning configuration of the three attention kernels (bf16, H = 64 and 128) and the RMSNorm
kernels is compiled down to a cubin in a subprocess without TRITON_INTERPRET.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SM90_MAX_SHARED = 227 * 1024  # bytes of shared memory one block may use on H100 / H200


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("kernel_aot.py")
    proc = subprocess.run([sys.executable, str(script), "90", "bf16", "64,128"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 * (6 + 5 + 5) + 2
    errors = [r for r in rows if "error" in r]
    assert not errors, errors
    too_big = [r for r in rows if r["shared"] > SM90_MAX_SHARED]
    assert not too_big, too_big
