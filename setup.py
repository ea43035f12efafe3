"""setuptools hook: ship ``src/lmstack-lm-eval.pth`` at the top of site-packages, in wheels and in
editable installs (``pip install -e .``), so lm-eval's own ``lm_eval`` command finds the ``lmstack``
model class (src/lmstack/_lm_eval_hook.py, docs/eval.md). Everything else is in pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "lmstack-lm-eval.pth"
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src", PTH)


class build_py_with_pth(build_py):
    """Regular wheels: the .pth next to the packages."""

    def run(self):
        super().run()
        self.copy_file(SRC, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class _WithPth:
    """Wraps setuptools' editable strategy: whatever it writes, plus our .pth."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        with open(SRC, "rb") as f:
            wheel.writestr(PTH, f.read())


class editable_wheel_with_pth(editable_wheel):
    """Editable installs (``pip install -e .``, what the Makefile runs)."""

    def _select_strategy(self, *args, **kw):
        return _WithPth(super()._select_strategy(*args, **kw))


cmdclass = {"build_py": build_py_with_pth}
if hasattr(editable_wheel, "_select_strategy"):  # setuptools >= 64's editable wheels (a private hook: skip if gone)
    cmdclass["editable_wheel"] = editable_wheel_with_pth
setup(cmdclass=cmdclass)
