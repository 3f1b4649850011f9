"""loadtest/'s scripts as modules, for the tests that drive their pieces (a benchmark's load
generator, its plot). Imported by path under the name ``loadtest.NAME``: the repo root stays
off sys.path (see conftest.py), and a script that needs it appends it, behind site-packages."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

LOADTEST = Path(__file__).resolve().parents[1] / "loadtest"


def loadtest_script(name: str) -> ModuleType:
    """``loadtest/NAME.py``, imported once."""
    key = f"loadtest.{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, LOADTEST / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]
