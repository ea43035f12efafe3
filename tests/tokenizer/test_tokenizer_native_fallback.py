"""The tokenizer without its native core: the Python path with a clear reason (runs on machines without a
compiler too, where the other native tests skip)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _run(code: str, **env) -> subprocess.CompletedProcess:
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    full = {**os.environ, "PYTHONPATH": os.path.abspath(src), **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120
    )


_FALLBACK = """
import json, tiktoken
from lmstack.tokenizer import Tokenizer, native
vocab = {i: bytes([i]) for i in range(256)}
vocab[256] = b"ab"
tok = Tokenizer(vocab, [(b"a", b"b")], ["<|e|>"])
print(json.dumps([tok.backend, native.status(), tok.encode("abab<|e|>x")]))
"""


@pytest.mark.parametrize(
    "env, reason",
    [
        ({"LMSTACK_TOKENIZER": "python"}, "LMSTACK_TOKENIZER=python"),
        ({"CXX": "/nonexistent/c++"}, "no C++ compiler (/nonexistent/c++) on PATH"),
    ],
)
def test_falls_back_to_python_with_a_reason(tmp_path, env, reason):
    out = _run(_FALLBACK, TORCH_EXTENSIONS_DIR=str(tmp_path), **env)  # an empty build cache
    assert out.returncode == 0, out.stderr
    backend, status, ids = json.loads(out.stdout.strip().splitlines()[-1])
    assert status == reason and backend == f"python ({reason})"
    assert ids == [256, 256, 257, 120]  # "ab" merged twice, the special, "x" (hand-worked)
