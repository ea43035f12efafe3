"""How ``lmstack.parallel`` is put together (docs/parallel.md, "Structure"): the trainer's interface
``ParallelWrapper`` is implemented by both backends, no module of the package imports another's
private names, and ``native`` does not import ``plan`` (the dispatch imports both, not a cycle)."""

import ast
import inspect
from pathlib import Path

import lmstack.parallel as P
from lmstack.parallel.interface import ParallelWrapper
from lmstack.parallel.native import NativeParallelModel
from lmstack.parallel.plan import ParallelModel

SRC = Path(P.__file__).parent


def _trees():
    for path in sorted(SRC.glob("*.py")):
        yield path.name, ast.parse(path.read_text(encoding="utf-8"))


def test_both_backends_implement_the_protocol():
    members = [n for n in dir(ParallelWrapper) if not n.startswith("_")] + list(
        ParallelWrapper.__annotations__
    )
    for cls in (ParallelModel, NativeParallelModel):
        src = inspect.getsource(cls) + inspect.getsource(cls.__mro__[1])
        for name in members:
            assert hasattr(cls, name) or f"self.{name}" in src, f"{cls.__name__} lacks {name}"


def test_no_private_imports_and_no_plan_native_cycle():
    bad = []
    for name, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lmstack"):
                bad += [
                    f"{name}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                ]
                if name == "native.py" and node.module == "lmstack.parallel.plan":
                    bad.append("native.py imports plan")
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "C"
                and node.attr.startswith("_")
            ):
                bad.append(f"{name}: C.{node.attr}")
    assert bad == []


def test_no_instance_method_patching():
    """Nothing in the package assigns one of its functions to another object's attribute
    (``pm.build_optimizer = build_optimizer``)."""
    bad = []
    for name, tree in _trees():
        defs = {
            n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Name)
                and node.value.id in defs
            ):
                bad += [
                    f"{name}:{node.lineno}"
                    for t in node.targets
                    if isinstance(t, ast.Attribute)
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                ]
    assert bad == []


def test_pipeline_stages_chained_equal_the_model():
    """Stages are the model's own class on a slice of its layers, run by its own forward: chained,
    they give the model's logits (tied embeddings: the last stage's copy of W_e)."""
    import torch

    from lmstack.model.config import ModelConfig
    from lmstack.model.transformer import Transformer
    from lmstack.parallel.pipeline import pipeline_stage

    for tie in (False, True):
        cfg = ModelConfig(
            vocab_size=64,
            d_model=32,
            n_layers=3,
            n_heads=4,
            n_kv_heads=2,
            d_ff=64,
            max_seq_len=32,
            tie_embeddings=tie,
        )
        model = Transformer(cfg, seed=0)
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        x = tokens
        for s in range(3):
            stage = pipeline_stage(model, s, 3)
            assert type(stage) is Transformer and len(stage.blocks) == 1
            x = stage(x)
        torch.testing.assert_close(x, model(tokens))
