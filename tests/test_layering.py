"""The layering rule, read from the source (parsed, never imported):

    api/ -> actors/ -> core/ -> text/        engine/ -> kernels/
    (each may import what stands to its right; messages and config are shared by all)

- no import circle anywhere in tinyserve/ and kernels/ (imports inside functions and under
  TYPE_CHECKING count: a circle that only runs late is still a circle to a reader);
- api/, actors/, core/ and text/ never import torch, triton, engine/ or kernels/ (the control
  plane runs and is tested without them), nor a package to their left;
- kernels/ imports nothing of tinyserve but itself.

Each failure names the file, the line and the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ("torch", "triton", "tinyserve.engine", "tinyserve.kernels")
# package -> what it may not import (beyond DEVICE for the control plane)
LEFT_OF = {
    "tinyserve.api": (),
    "tinyserve.actors": ("tinyserve.api",),
    "tinyserve.core": ("tinyserve.api", "tinyserve.actors"),
    "tinyserve.text": ("tinyserve.api", "tinyserve.actors", "tinyserve.core"),
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "kernels":  # installed as tinyserve.kernels (pyproject's package-dir)
        parts = ["tinyserve", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*sorted((ROOT / "tinyserve").rglob("*.py")), *sorted((ROOT / "kernels").rglob("*.py"))]
    return {_module_name(p): p for p in files}


def _imports(name: str, source: str, is_package: bool, modules: set[str]
             ) -> list[tuple[int, str]]:
    """(line, imported module) for every import in a module's source, relative ones
    resolved; a ``from package import submodule`` names the submodule."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if sub in modules else base))
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _graph() -> tuple[dict[str, Path], dict[str, list[tuple[int, str]]]]:
    sources = _sources()
    names = set(sources)
    return sources, {n: _imports(n, p.read_text(), p.name == "__init__.py", names)
                     for n, p in sources.items()}


def _where(sources: dict[str, Path], module: str, line: int) -> str:
    return f"{sources[module].relative_to(ROOT)}:{line}"


def test_control_plane_never_imports_the_device_side_or_a_layer_above():
    sources, graph = _graph()
    bad = []
    for module, imports in graph.items():
        for package, left in LEFT_OF.items():
            if not _within(module, package):
                continue
            for line, target in imports:
                for banned in (*DEVICE, *left):
                    if _within(target, banned):
                        bad.append(f"{_where(sources, module, line)} imports {target} "
                                   f"({package.split('.')[1]}/ must not import {banned})")
    assert not bad, "\n".join(bad)


def test_kernels_import_nothing_of_tinyserve_but_themselves():
    sources, graph = _graph()
    bad = [f"{_where(sources, m, line)} imports {t}"
           for m, imports in graph.items() if _within(m, "tinyserve.kernels")
           for line, t in imports
           if _within(t, "tinyserve") and not _within(t, "tinyserve.kernels")]
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    sources, graph = _graph()
    edges = {m: sorted({t for _, t in imports if t in graph and t != m})
             for m, imports in graph.items()}
    lines = {(m, t): line for m, imports in graph.items() for line, t in imports}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        path.append(m)
        for t in edges[m]:
            if state.get(t) == 1:
                loop = path[path.index(t):] + [t]
                circles.append(" -> ".join(
                    f"{a} ({_where(sources, a, lines[a, b])})" for a, b in zip(loop, loop[1:]))
                    + f" -> {t}")
            elif t not in state:
                visit(t, path)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_rule_names_what_it_forbids():
    """The checks above see what they must: a plain import, a relative one, one inside a
    function, and ``from package import submodule``."""
    names = {"tinyserve.api", "tinyserve.api.x", "tinyserve.engine", "tinyserve.engine.runner"}
    src = "import torch\nfrom . import x\n\ndef f():\n    from tinyserve.engine import runner\n"
    got = _imports("tinyserve.api.probe", src, False, names)
    assert got == [(1, "torch"), (2, "tinyserve.api.x"), (5, "tinyserve.engine.runner")]
