"""The serve and structured extras: without their packages the base install still runs every other
command, and using the feature names the extra to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from lmstack.utils import MissingExtraError

SERVE_PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "llguidance")


def test_server_without_fastapi_names_the_serve_extra(monkeypatch):
    import lmstack.serve

    monkeypatch.setitem(sys.modules, "fastapi", None)  # None in sys.modules: import raises
    with pytest.raises(MissingExtraError, match=r"pip install 'lmstack\[serve\]'") as e:
        lmstack.serve.Server  # noqa: B018
    assert "'fastapi'" in str(e.value) and e.value.name == "fastapi"


def test_serve_command_without_uvicorn_exits_2_naming_the_extra(monkeypatch, capsys):
    from lmstack.cli import main

    monkeypatch.delenv("LMSTACK_API_KEY", raising=False)
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert main(["serve", "--model", "no-such-model"]) == 2  # refused before the model loads
    err = capsys.readouterr().err
    assert "lmstack serve needs the 'uvicorn' package" in err
    assert "pip install 'lmstack[serve]'" in err


def test_structured_output_without_llguidance_names_its_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "lmstack.serve.structured", raising=False)
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'lmstack\[structured\]'"):
        import lmstack.serve.structured  # noqa: F401


def test_base_install_builds_every_command_without_the_serve_packages():
    # a fresh interpreter in which the serve/structured packages cannot be imported, as after a plain
    # `pip install -e .`: the command line (demo included) still builds, and nothing imported FastAPI
    code = textwrap.dedent(
        f"""
        import sys
        for m in {SERVE_PACKAGES!r}:
            sys.modules[m] = None
        from lmstack.cli import build_parser
        build_parser().parse_args(["demo", "--help"])
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr  # argparse's --help exits 0
    assert "usage: lmstack demo" in r.stdout
