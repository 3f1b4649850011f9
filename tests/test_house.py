"""The house's shape, read from the source: small modules and functions, every module on the
map (docs/architecture.md), every package installed (pyproject.toml)."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
# The command line's flag table: one add_argument after another, read as a table
LONG_BY_DESIGN = {("tinyserve/cli/flags.py", "build_parser")}


def _modules() -> list[Path]:
    return sorted([*(ROOT / "tinyserve").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])


def test_no_module_over_400_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, long


def test_no_function_over_80_lines():
    long = []
    for p in (ROOT / "tinyserve").rglob("*.py"):
        rel = str(p.relative_to(ROOT))
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES and (rel, node.name) not in LONG_BY_DESIGN:
                    long.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert not long, long


def test_the_architecture_page_names_every_module():
    """Each module by its file name, where the page's layout puts it (an __init__ names its
    package); a module the page names that no longer exists fails too."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    layout = page[page.index("## Layout"):page.index("## The layering rule")]
    missing = []
    for p in _modules():
        if p.name == "__init__.py":
            continue
        if not re.search(rf"(?<![\w/]){re.escape(p.name)}\b", layout):
            missing.append(str(p.relative_to(ROOT)))
    assert not missing, f"docs/architecture.md's layout does not name: {missing}"
    names = set(re.findall(r"(?<![\w/.])([a-z_][a-z0-9_]*\.py)\b", layout))
    existing = {p.name for p in _modules()}
    assert names <= existing, f"the layout names modules that do not exist: {names - existing}"


def test_pyproject_installs_every_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = {p.parent for p in (ROOT / "tinyserve").rglob("__init__.py")}
    packages = {".".join(d.relative_to(ROOT).parts) for d in dirs} | {"tinyserve.kernels"}
    assert packages == listed, (sorted(packages - listed), sorted(listed - packages))
