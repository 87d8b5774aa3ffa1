"""Dependency direction: tidal/parallel builds on tidal/models and never on tidal/train."""

from __future__ import annotations

import ast
from pathlib import Path

import tidal.parallel

PARALLEL_DIR = Path(tidal.parallel.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` in the file names, at any depth (function
    bodies included), with relative imports resolved against tidal.parallel; for `from a
    import b` both a and a.b."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # from . import x / from ..train import y
                base = "tidal.parallel".rsplit(".", node.level - 1)[0]
                module = f"{base}.{module}" if module else base
            names.add(module)
            # `from tidal import train` names the module tidal.train.
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_parallel_imports_nothing_from_train():
    files = sorted(PARALLEL_DIR.rglob("*.py"))
    assert files, PARALLEL_DIR
    offenders = {
        f"{path.relative_to(PARALLEL_DIR)}: {name}"
        for path in files
        for name in _imported_modules(path)
        if name == "tidal.train" or name.startswith("tidal.train.")
    }
    assert not offenders, f"tidal/parallel imports tidal/train: {sorted(offenders)}"
