"""The package's C++ sources (`pipeline.native`): shipped with it, and built on first use."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_cpp_source_ships_with_the_package():
    """Each .cpp the package compiles on first use is package data: a wheel without one (the
    copying drafters' lookups were missing from `package-data` for a week) installs fine and
    runs everything in Python, one warning in a worker's log the only sign."""
    config = (ROOT / "pyproject.toml").read_text()
    table = config.split("[tool.setuptools.package-data]", 1)[1]
    globs = ast.literal_eval(re.search(r"^pipeline = (\[.*\])$", table, re.M).group(1))
    package = ROOT / "pipeline"
    sources = [p.relative_to(package).as_posix() for p in package.rglob("*.cpp")]
    assert sources
    missing = [s for s in sources if not any(fnmatch.fnmatch(s, g) for g in globs)]
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
