"""Makes lm-evaluation-harness's own ``lm_eval`` command find the ``lmstack`` model class (CS336 notes
"基准测试": lm-eval as a first-class client). docs/eval.md explains why this exists.

lm-eval 0.4.13 resolves ``--model NAME`` in ``lm_eval.api.registry.model_registry``, which is filled
only by ``lm_eval.models`` (its own ``MODEL_MAPPING``) and by ``register_model`` calls in modules someone
imported; it reads no entry points. So the installed package ships ``lmstack-lm-eval.pth`` (one line:
``import lmstack._lm_eval_hook``), and this module, run at interpreter start, puts a finder on
``sys.meta_path`` that does nothing until ``lm_eval.models`` is imported. Right after that module runs,
it registers ``lmstack`` as a *lazy* placeholder ``"lmstack.eval.harness:LMStackLM"`` — lm-eval's own
registry form for not-yet-imported models — so nothing of lmstack or torch is imported until lm-eval
actually asks for ``lmstack``. Importing this module costs a class definition; without lm-eval installed
the finder never fires. ``LMSTACK_NO_LM_EVAL_HOOK=1`` turns it off.
"""

from __future__ import annotations

import os
import sys

NAME = "lmstack"
TARGET = "lmstack.eval.harness:LMStackLM"


def register() -> None:
    """Register the lazy ``lmstack`` placeholder in lm-eval's model registry (idempotent)."""
    from lm_eval.api.registry import model_registry

    if NAME not in model_registry:
        model_registry.register(NAME, target=TARGET)


class _Loader:
    """Runs the real loader of ``lm_eval.models``, then registers ``lmstack``."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            register()
        except Exception as e:  # never break lm-eval itself over the plugin
            print(
                f"lmstack: could not register the 'lmstack' lm-eval model: {e!r}", file=sys.stderr
            )


class _Finder:
    """A ``sys.meta_path`` finder that only answers for ``lm_eval.models`` (once)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "lm_eval.models":
            return None
        import importlib.util

        sys.meta_path.remove(self)  # the real finders locate the module; we only wrap its loader
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if os.environ.get("LMSTACK_NO_LM_EVAL_HOOK"):
        return
    if "lm_eval.models" in sys.modules:  # imported before us: register now
        try:
            register()
        except Exception:
            pass
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
