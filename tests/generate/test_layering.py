"""Dependency direction of the generation engine (tidal/generate), read from the imports of
every file (at any depth, function bodies included):

- the engine imports only the standard library, torch and tidal.models (and itself); the
  command line (cli.py) adds tidal.train's configs, tokenizer and checkpoint reader, and the
  text libraries of its prompts (jinja2 for chat templates, tokenizers);
- nothing in tidal/models or tidal/train imports tidal.generate (the `tidal train` command
  line calls the engine for its end-of-run sample);
- no file of tidal/generate imports another's private (`_name`) members or reads a private
  attribute of anything but its own `self`/`cls`;
- no two files of tidal/generate import each other in a circle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tidal.generate
import tidal.models
import tidal.train

GENERATE_DIR = Path(tidal.generate.__file__).parent
FILES = sorted(GENERATE_DIR.rglob("*.py"))
ENGINE_ALLOWED = ("torch", "tidal.models", "tidal.generate")
CLI_ALLOWED = (*ENGINE_ALLOWED, "tidal.train", "jinja2", "tokenizers")


def _module_of(path: Path) -> str:
    parts = path.relative_to(GENERATE_DIR.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) of every import in the file, relative ones resolved."""
    out = []
    package = _module_of(path) if path.name == "__init__.py" else _module_of(path).rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.rsplit(".", node.level - 1)[0]
                module = f"{base}.{module}" if module else base
            out.append((module, [alias.name for alias in node.names]))
    return out


def _within(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def _third_party_or_tidal(module: str) -> bool:
    top = module.split(".")[0]
    return top not in sys.stdlib_module_names and top != "__future__"


def test_files_are_found():
    names = {p.name for p in FILES}
    assert {"generator.py", "sampler.py", "slots.py", "scoring.py", "weights.py", "cli.py"} <= names


def test_the_engine_imports_only_torch_and_models():
    offenders = []
    for path in FILES:
        allowed = CLI_ALLOWED if path.name == "cli.py" else ENGINE_ALLOWED
        for module, _ in _imports(path):
            if _third_party_or_tidal(module) and not _within(module, allowed):
                offenders.append(f"{path.relative_to(GENERATE_DIR)}: {module}")
    assert not offenders, f"tidal/generate imports outside its layer: {offenders}"


def test_models_and_train_never_import_the_engine():
    offenders = [
        f"{path}: {module}"
        for package in (tidal.models, tidal.train)
        for path in sorted(Path(package.__file__).parent.rglob("*.py"))
        for module, names in _imports(path)
        if _within(module, ("tidal.generate",)) or (module == "tidal" and "generate" in names)
    ]
    assert not offenders, offenders


def test_no_file_reaches_another_files_private_members():
    offenders = []
    for path in FILES:
        own = _module_of(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for module, names in _imports(path):
            if _within(module, ("tidal.generate",)) and module != own:
                offenders += [
                    f"{path.name}: from {module} import {n}" for n in names if _private(n)
                ]
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                offenders.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not offenders, f"private members reached from outside their file: {offenders}"


def test_no_circular_imports():
    # The package's __init__ is a node too: a file importing `tidal.generate` closes a circle.
    graph = {
        _module_of(path): {m for m, _ in _imports(path) if _within(m, ("tidal.generate",))}
        for path in FILES
    }

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False

    circles = sorted(m for m in graph if reaches(m, m, {m}))
    assert not circles, f"tidal/generate modules in an import circle: {circles}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")
