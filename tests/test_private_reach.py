"""Tests use tidal through its public names: no test imports, reads, calls or monkeypatches a
private (`_name`) member of a tidal module or object. Where a test needs a way in (a step to
replace, a kernel to check on its own), the module offers a public, documented one.

A test helper's own private names inside tests/ (`tests/parallel/_launch.py`) are fine, as
are torch's (`torch._dynamo`, `torch.cuda._sleep`)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent

ALLOWED = {
    "lib._destroy": "torch.library.Library has no public way to drop its registrations",
}
"""Private attributes of other libraries' objects that tests reach on purpose, and why."""

THIRD_PARTY_ROOTS = {"torch", "aten", "_aten"}
"""Names whose private attributes belong to another library."""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _reaches(source: str, where: str) -> list[str]:
    """Each reach into a private tidal member in the Python `source` of file `where`."""
    tree = ast.parse(source, filename=where)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tidal":
            module = node.module or ""
            names = [a.name for a in node.names]
            if any(_private(p) for p in module.split(".")) or any(map(_private, names)):
                found.append((node.lineno, f"from {module} import {', '.join(names)}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "tidal" and any(_private(p) for p in parts):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = _root(node.value)
            text = ast.unparse(node)
            if root in ("self", "cls", *THIRD_PARTY_ROOTS) or text in ALLOWED:
                continue
            if root == "tests" or text.startswith("tests."):
                continue  # a test helper module's own name
            found.append((node.lineno, text))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("setattr", "delattr")
            and node.args
        ):
            args = node.args
            if isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
                target = args[0].value  # monkeypatch.setattr("tidal.x.name", value)
                if target.startswith("tidal.") and any(_private(p) for p in target.split(".")):
                    found.append((node.lineno, f"setattr {target!r}"))
            elif (
                len(args) > 1
                and isinstance(args[1], ast.Constant)
                and isinstance(args[1].value, str)
                and _private(args[1].value)
                and _root(args[0]) not in THIRD_PARTY_ROOTS
            ):
                found.append((node.lineno, f"setattr {ast.unparse(args[0])}, {args[1].value!r}"))
    return [f"{where}:{line}: {text}" for line, text in sorted(found)]


def test_the_check_sees_each_kind_of_reach():
    code = (
        "from tidal.train.loss import _chunk_eager\n"
        "from tidal.rl.tools._launcher import X\n"
        "import tidal.train._private\n"
        "trainer._release_locks()\n"
        "monkeypatch.setattr(cli, '_launch', None)\n"
        "monkeypatch.setattr('tidal.cli._launch', None)\n"
        # none of these is a reach into tidal:
        "from tests.parallel._launch import run_ranks\n"
        "self._x = torch._dynamo\n"
        "torch.cuda._sleep(1)\n"
        "lib._destroy()\n"
        "monkeypatch.setattr(torch, '_foo', 1)\n"
        "from tidal.train.loss import cross_entropy_sum\n"
    )
    found = _reaches(code, "sample.py")
    assert [line.split(": ", 1)[1] for line in found] == [
        "from tidal.train.loss import _chunk_eager",
        "from tidal.rl.tools._launcher import X",
        "import tidal.train._private",
        "trainer._release_locks",
        "setattr cli, '_launch'",
        "setattr 'tidal.cli._launch'",
    ]


def test_no_test_reaches_into_private_members_of_tidal():
    found = [
        line
        for path in sorted(TESTS.rglob("*.py"))
        for line in _reaches(path.read_text(), str(path.relative_to(TESTS.parent)))
    ]
    assert not found, (
        "tests reach private members of tidal (use a public name, or make the needed way in "
        "a documented public one):\n" + "\n".join(found)
    )
