"""tidal/rl is the algorithm; tidal/rl/distributed is the same loop as processes. Nothing in
tidal/rl outside distributed/ imports the store or process code (DESIGN.md, "RL"): the
one-process loop (tidal/rl/grpo.py) and the pieces it is built from run without them."""

from __future__ import annotations

import ast
from pathlib import Path

import tidal.rl

RL_DIR = Path(tidal.rl.__file__).parent

FORBIDDEN = (
    "tidal.store",
    "tidal.rl.distributed",
    "tidal.parallel.launch",
    "subprocess",
    "multiprocessing",
)
"""Modules (and their submodules) the algorithm's files must not import."""

SANDBOXED = {"subprocess"}
"""What tidal/rl/tools/ may import besides: its sandbox runs model-written code in a child
process of its own, by design (never in a role's process)."""


def imported_modules(source: str, package: str) -> set[str]:
    """Every module an `import` or `from ... import` in `source` (a module of `package`)
    names, at any depth (function bodies included), relative imports resolved; for `from a
    import b` both a and a.b."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.rsplit(".", node.level - 1)[0]
                module = f"{base}.{module}" if module else base
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_the_algorithm_imports_no_store_and_no_process_code():
    files = [
        p for p in sorted(RL_DIR.rglob("*.py")) if "distributed" not in p.relative_to(RL_DIR).parts
    ]
    assert RL_DIR / "grpo.py" in files and len(files) > 10, files
    offenders = sorted(
        f"{path.relative_to(RL_DIR)}: {name}"
        for path in files
        for name in imported_modules(path.read_text(), _package(path))
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
        and not ("tools" in path.relative_to(RL_DIR).parts and name in SANDBOXED)
    )
    assert not offenders, f"tidal/rl outside distributed/ imports process code: {offenders}"


def _package(path: Path) -> str:
    return ".".join(path.relative_to(RL_DIR.parents[1]).parts[:-1])


def test_the_check_sees_an_import_inside_a_function():
    inside = "def f():\n    from tidal.store.errors import StoreError\n"
    assert "tidal.store.errors" in imported_modules(inside, "tidal.rl")
    relative = "from ..distributed import coupling\n"
    assert "tidal.rl.distributed.coupling" in imported_modules(relative, "tidal.rl.tasks")
