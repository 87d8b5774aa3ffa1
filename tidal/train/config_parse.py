"""Command-line overrides, help and printing for the nested config dataclasses.

`apply_overrides(config, ["--training.steps", "20", "--model.flavor=debug"])` returns a new
config: the current values become a dict, the overrides (parsed by each field's type) replace
entries, and the dataclasses are rebuilt, so every `__post_init__` validation runs again on
the final values. Field documentation is the string literal under each field, read from the
class source.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import types
import typing
from typing import Any, Literal, get_args, get_origin

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, keyed by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    cls_def = tree.body[0]
    assert isinstance(cls_def, ast.ClassDef), f"{cls} source is not a class definition"
    body = cls_def.body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _sections(config) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def type_name(tp: Any) -> str:
    """Short display name of a field type: INT, FLOAT, {a,b}, STR|NONE."""
    if get_origin(tp) is Literal:
        return "{" + ",".join(str(a) for a in get_args(tp)) + "}"
    if get_origin(tp) in (typing.Union, types.UnionType):
        return "|".join(type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "NONE"
    if _record_type(tp) is not None or tp is dict or get_origin(tp) is dict:
        return "JSON"
    if _int_tuple(tp):
        return "INT,INT,..."
    return getattr(tp, "__name__", str(tp)).upper()


def parse_value(raw: str, tp: Any, where: str) -> Any:
    """Convert a command-line string to a value of type `tp`, or raise ValueError."""
    origin = get_origin(tp)
    if origin is Literal:
        for choice in get_args(tp):
            if str(choice) == raw:
                return choice
        raise ValueError(f"{where}: {raw!r} is not one of {', '.join(map(str, get_args(tp)))}")
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if type(None) in args and raw.lower() in ("none", "null"):
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return parse_value(raw, a, where)
            except ValueError:
                continue  # try the next member of the union
        raise ValueError(f"{where}: cannot read {raw!r} as {type_name(tp)}")
    if tp is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"{where}: expected a boolean (true/false), got {raw!r}")
    if tp in (int, float):
        try:
            return tp(raw)
        except ValueError:
            raise ValueError(f"{where}: expected {tp.__name__}, got {raw!r}") from None
    if tp is str:
        return raw
    if _int_tuple(tp):
        try:
            return tuple(int(x) for x in raw.strip("[]() ").split(","))
        except ValueError:
            raise ValueError(
                f"{where}: expected integers separated by commas, got {raw!r}"
            ) from None
    item = _record_type(tp)
    if item is not None:
        return _parse_records(raw, item, where)
    if tp is dict or get_origin(tp) is dict:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: expected a JSON object, got {raw!r} ({e.msg})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a JSON object, got {raw!r}")
        return data
    raise TypeError(f"{where}: fields of type {tp} cannot be set from the command line")


def _int_tuple(tp: Any) -> bool:
    """`tuple[int, ...]`: given as "2,1" (or "[2, 1]")."""
    return get_origin(tp) is tuple and get_args(tp) == (int, Ellipsis)


def _record_type(tp: Any) -> type | None:
    """`X` for `tuple[X, ...]` with X a dataclass (a list of records, given as JSON)."""
    args = get_args(tp)
    if get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        if dataclasses.is_dataclass(args[0]) and isinstance(args[0], type):
            return args[0]
    return None


def _parse_records(raw: str, item: type, where: str) -> tuple:
    """A JSON list of objects (or one object) -> a tuple of `item` dataclasses."""
    fields = sorted(f.name for f in dataclasses.fields(item))
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{where}: expected a JSON list of objects with keys from {fields}, got {raw!r} "
            f"({e.msg})"
        ) from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise ValueError(f"{where}: expected a JSON list of objects, got {raw!r}")
    out = []
    for i, d in enumerate(data):
        unknown = sorted(set(d) - set(fields))
        if unknown:
            raise ValueError(f"{where}: entry {i} has unknown key(s) {unknown}; keys are {fields}")
        out.append(item(**d))
    return tuple(out)


def split_overrides(argv: list[str]) -> dict[str, str | None]:
    """["--a.b", "1", "--c.d=x", "--e.f"] -> {"a.b": "1", "c.d": "x", "e.f": None}: a flag
    followed by another flag (or nothing) has no value, which a boolean field reads as true
    (`--checkpoint.enable`, as torchtitan spells it)."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(
                f"unexpected argument {arg!r}; overrides look like --section.field VALUE"
            )
        key = arg[2:]
        value: str | None = None
        if "=" in key:
            key, value = key.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            i += 1
            value = argv[i]
        out[key] = value
        i += 1
    return out


def apply_overrides(config, argv: list[str]):
    """A new config with `--section.field value` overrides applied and validated."""
    values = {name: dataclasses.asdict(sec) for name, sec in _sections(config).items()}
    for key, raw in split_overrides(argv).items():
        section, _, name = key.partition(".")
        if section not in values or not name:
            raise ValueError(f"unknown config section in --{key}; sections are {sorted(values)}")
        sec_cls = type(getattr(config, section))
        hints = _hints(sec_cls)
        if name not in hints:
            raise ValueError(f"unknown field --{key}; {section} has {', '.join(sorted(hints))}")
        if raw is None:
            if hints[name] is not bool:
                raise ValueError(f"override --{key} needs a value")
            raw = "true"
        values[section][name] = parse_value(raw, hints[name], f"--{key}")
    return build(type(config), values)


def build(cls: type, values: dict[str, dict[str, Any]]):
    """Rebuild a config of class `cls` from nested dicts (validation runs again)."""
    hints = _hints(cls)
    sections = {}
    for name, sec_values in values.items():
        try:
            sections[name] = hints[name](**sec_values)
        except ValueError as e:
            raise ValueError(f"invalid config: {e}") from None
    try:
        return cls(**sections)
    except ValueError as e:
        raise ValueError(f"invalid config: {e}") from None


def to_dict(config) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(sec) for name, sec in _sections(config).items()}


def to_json(config) -> str:
    return json.dumps(to_dict(config), indent=2)


def help_text(config, config_name: str) -> str:
    """Every field of every section: flag, type, value in this config, and its doc."""
    lines = [f"Fields of config {config_name!r} (override with --section.field VALUE):", ""]
    for name, sec in _sections(config).items():
        doc = (type(sec).__doc__ or "").strip().splitlines()[0]
        lines.append(f"[{name}] {doc}")
        docs, hints = field_docs(type(sec)), _hints(type(sec))  # type: ignore[arg-type]
        for f in dataclasses.fields(sec):
            value = getattr(sec, f.name)
            lines.append(f"  --{name}.{f.name} {type_name(hints[f.name])}  (default: {value!r})")
            for wrapped in textwrap.wrap(docs.get(f.name, ""), 90):
                lines.append(f"      {wrapped}")
        lines.append("")
    return "\n".join(lines)
