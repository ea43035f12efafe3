"""The wheel ships what the C++ kernels build from: every source under a ``csrc`` folder and every header it
includes in quotes matches the package's ``[tool.setuptools.package-data]`` globs in pyproject.toml (an
installed, non-editable lmstack compiles its kernels on first use from those files)."""

import fnmatch
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_csrc_file_and_quoted_include_is_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    sources = sorted((ROOT / "src" / "lmstack").glob("*/csrc/*.cpp"))
    assert sources, "no C++ sources found"
    missing = []
    for src in sources:
        pkg_dir = src.parent.parent
        pkg = "lmstack." + pkg_dir.name
        files = {src} | {
            (src.parent / inc).resolve()
            for inc in re.findall(r'^\s*#include\s+"([^"]+)"', src.read_text(), re.M)
        }
        for f in files:
            rel = f.relative_to(pkg_dir).as_posix()
            if not any(fnmatch.fnmatch(rel, glob) for glob in data.get(pkg, [])):
                missing.append(f"{pkg}: {rel}")
    assert not missing, f"not in package-data: {missing}"
