"""The layering rule, read from the source (parsed, never imported):

    cli/ -> server -> api/ -> actors/ -> core/ -> text/ -> formats/      engine/ -> kernels/
    (each may import what stands to its right; messages and config are shared by all)

- no import circle anywhere in tinyserve/ and kernels/, module by module or package by package
  (imports inside functions and under TYPE_CHECKING count: a circle that only runs late is
  still a circle to a reader);
- api/, actors/, core/ and text/ never import torch, triton, engine/ or kernels/ (the control
  plane runs and is tested without them), nor a package to their left;
- kernels/ and formats/ import nothing of tinyserve but themselves; only ``__main__`` and the
  fleet import cli/;
- the API's fronts stand apart: openai/, responses/ and anthropic/ import nothing of one
  another but the chat request (``api.openai.requests``) that every front translates to, and
  the shared pipeline imports no front but that (app.py wires them; ops/openapi.py describes
  them).

Each failure names the file, the line and the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ("torch", "triton", "tinyserve.engine", "tinyserve.kernels")
# package -> what it may not import (beyond DEVICE for the control plane)
LEFT_OF = {
    "tinyserve.api": ("tinyserve.cli", "tinyserve.server"),
    "tinyserve.actors": ("tinyserve.api", "tinyserve.cli", "tinyserve.server"),
    "tinyserve.core": ("tinyserve.api", "tinyserve.actors", "tinyserve.cli", "tinyserve.server"),
    "tinyserve.text": ("tinyserve.api", "tinyserve.actors", "tinyserve.core", "tinyserve.cli",
                       "tinyserve.server"),
}
LEAVES = ("tinyserve.kernels", "tinyserve.formats")  # import nothing of tinyserve but themselves
FRONTS = ("tinyserve.api.openai", "tinyserve.api.responses", "tinyserve.api.anthropic")
CHAT_REQUEST = "tinyserve.api.openai.requests"  # what every front translates to
WIRING = ("tinyserve.api.app", "tinyserve.api.ops.openapi")  # may import every front
CLI_USERS = ("tinyserve.__main__", "tinyserve.cli", "tinyserve.fleet")

Graph = dict[str, list[tuple[int, str]]]


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


def _graph() -> tuple[dict[str, Path], Graph]:
    sources = _sources()
    names = set(sources)
    return sources, {n: _imports(n, p.read_text(), p.name == "__init__.py", names)
                     for n, p in sources.items()}


def _where(sources: dict[str, Path], module: str, line: int) -> str:
    path = sources.get(module)
    return f"{path.relative_to(ROOT) if path else module}:{line}"


def layering_violations(sources: dict[str, Path], graph: Graph) -> list[str]:
    """Every import that breaks the rule, named by file, line and import."""
    bad = []
    for module, imports in graph.items():
        for line, target in imports:
            for why in _broken(module, target):
                bad.append(f"{_where(sources, module, line)} imports {target} ({why})")
    return bad


def _broken(module: str, target: str) -> list[str]:
    """Why ``module`` may not import ``target`` (nothing: it may)."""
    why = []
    for package, left in LEFT_OF.items():
        if _within(module, package):
            why += [f"{package.split('.')[1]}/ must not import {banned}"
                    for banned in (*DEVICE, *left) if _within(target, banned)]
    for leaf in LEAVES:
        if (_within(module, leaf) and _within(target, "tinyserve")
                and not _within(target, leaf)):
            why.append(f"{leaf.split('.')[1]}/ imports nothing of tinyserve but itself")
    if _within(target, "tinyserve.cli") and not any(_within(module, u) for u in CLI_USERS):
        why.append("only __main__ and the fleet import the command line")
    front = next((f for f in FRONTS if _within(target, f)), None)
    if front is not None and not _within(target, CHAT_REQUEST) and not _within(module, front) \
            and module not in WIRING and _within(module, "tinyserve.api"):
        why.append(f"a front's modules are its own: only {CHAT_REQUEST} is shared")
    return why


def test_the_layers_import_only_what_stands_to_their_right():
    sources, graph = _graph()
    bad = layering_violations(sources, graph)
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    sources, graph = _graph()
    circles = _circles({m: sorted({t for _, t in imports if t in graph and t != m})
                        for m, imports in graph.items()})
    lines = {(m, t): line for m, imports in graph.items() for line, t in imports}
    assert not circles, "import circles:\n" + "\n".join(
        " -> ".join(f"{a} ({_where(sources, a, lines[a, b])})" for a, b in zip(c, c[1:]))
        + f" -> {c[-1]}" for c in circles)


def _unit(module: str) -> str:
    """A module's package under tinyserve (``tinyserve.core``), or the top-level module."""
    return ".".join(module.split(".")[:2])


def test_no_circles_between_packages():
    """config <-> core and the like: a package that imports another which imports it back is
    one knot, whichever modules carry the two imports."""
    _, graph = _graph()
    edges: dict[str, set[str]] = {}
    for m, imports in graph.items():
        for _, t in imports:
            if t in graph and _unit(t) != _unit(m):
                edges.setdefault(_unit(m), set()).add(_unit(t))
    circles = _circles({u: sorted(ts) for u, ts in edges.items()})
    assert not circles, "package circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def _circles(edges: dict[str, list[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    found = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        path.append(m)
        for t in edges.get(m, ()):
            if state.get(t) == 1:
                found.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path)
        path.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    return found


def test_the_rule_names_what_it_forbids():
    """The checks above see what they must: a plain import, a relative one, one inside a
    function, and ``from package import submodule``."""
    names = {"tinyserve.api", "tinyserve.api.x", "tinyserve.engine", "tinyserve.engine.runner"}
    src = "import torch\nfrom . import x\n\ndef f():\n    from tinyserve.engine import runner\n"
    got = _imports("tinyserve.api.probe", src, False, names)
    assert got == [(1, "torch"), (2, "tinyserve.api.x"), (5, "tinyserve.engine.runner")]


def test_an_api_module_that_imports_the_engine_fails_the_rule():
    """Shown on the real tree with one import added: api/generate.py reaching for the
    runner, and a front reaching into another's shaper."""
    sources, graph = _graph()
    assert not layering_violations(sources, graph)
    graph = {**graph,
             "tinyserve.api.generate": [*graph["tinyserve.api.generate"],
                                        (999, "tinyserve.engine.running.runner")],
             "tinyserve.api.anthropic.routes": [*graph["tinyserve.api.anthropic.routes"],
                                                (998, "tinyserve.api.openai.chat")]}
    assert sorted(layering_violations(sources, graph)) == [
        "tinyserve/api/anthropic/routes.py:998 imports tinyserve.api.openai.chat (a front's "
        "modules are its own: only tinyserve.api.openai.requests is shared)",
        "tinyserve/api/generate.py:999 imports tinyserve.engine.running.runner (api/ must not "
        "import tinyserve.engine)"]
