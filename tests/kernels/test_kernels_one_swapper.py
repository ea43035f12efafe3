"""Issue #29 item 4: kernels.runtime (configure, use_attention, install_attention) is the only code that swaps a
model's attention or norm implementation; no other module of src/ calls set_attention / set_norm."""

import ast
from pathlib import Path

import lmstack

SWAPS = {"set_attention", "set_norm"}


def test_only_kernels_runtime_swaps_implementations():
    root = Path(lmstack.__file__).parent
    callers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in SWAPS
            ):
                callers.add(path.relative_to(root).as_posix())
    assert callers == {"kernels/runtime.py"}
