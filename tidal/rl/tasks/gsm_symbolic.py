"""`gsm_symbolic`: GSM8K-style word problems from reasoning-gym's GSM-Symbolic templates.

Needs `reasoning-gym==0.1.25`, installed without its dependencies::

    pip install --no-deps reasoning-gym==0.1.25

Importing `reasoning_gym` itself pulls in every dataset it ships and their dependencies
(sympy, cellpylib, ...). The 100 GSM-Symbolic generators need only the standard library and
`reasoning_gym/utils.py` (itself standard library), so this module loads those three files
directly, by path, without running the package's `__init__`: while it loads them, a bare
stand-in package named `reasoning_gym` (holding only `utils`) serves their
`from reasoning_gym.utils import ...`, and `sys.modules` is restored afterwards. If the real
package is already imported, its modules are used as they are.

Templates: the 85 that reasoning-gym 0.1.25 marks as correct (`tasks_ok` in its
gsm_symbolic.py, copied below); each problem draws a template, then names and numbers.
Splits: by default a problem's key is its question text (eval holds unseen instances of
templates also seen in training, which is what GSM-Symbolic measures); `holdout="template"`
holds out whole templates instead, for a test of transfer to unseen problem kinds.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tidal.rl.tasks.answers import grade_number
from tidal.rl.tasks.base import Grade, Problem, Task, register

INSTALL = "pip install --no-deps reasoning-gym==0.1.25"

TEMPLATES = (
    *range(32),
    33,
    34,
    36,
    38,
    39,
    40,
    41,
    42,
    43,
    44,
    45,
    46,
    47,
    48,
    49,
    50,
    51,
    52,
    53,
    54,
    55,
    56,
    57,
    58,
    59,
    60,
    62,
    64,
    66,
    67,
    68,
    69,
    70,
    71,
    72,
    73,
    75,
    78,
    80,
    81,
    82,
    83,
    84,
    85,
    88,
    89,
    91,
    92,
    93,
    94,
    95,
    96,
    99,
)
"""Template numbers reasoning-gym 0.1.25 lists as correct (`tasks_ok`)."""

DEFAULT_SUFFIX = '\nEnd your answer with a line "#### <number>", without units.'

_load_lock = threading.Lock()  # sys.modules is shared by the process's threads


def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_generators() -> dict[int, Callable[[random.Random, float], dict[str, Any]]]:
    """reasoning-gym's GSM-Symbolic generator functions by template number.

    Raises:
        ModuleNotFoundError: reasoning-gym is not installed (the message says how).
    """
    spec = importlib.util.find_spec("reasoning_gym")  # finds, does not import, a top package
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"task 'gsm_symbolic' needs reasoning-gym: {INSTALL}")
    root = Path(next(iter(spec.submodule_search_locations)))
    folder = root / "arithmetic" / "gsm_symbolic"
    parts = [folder / f"generators_{span}.py" for span in ("00_49", "50_99")]
    if not all(p.is_file() for p in parts):
        raise ModuleNotFoundError(
            f"reasoning-gym at {root} has no {folder.relative_to(root)}/generators_*.py; "
            f"task 'gsm_symbolic' needs version 0.1.25: {INSTALL}"
        )
    names = ("reasoning_gym", "reasoning_gym.utils")
    with _load_lock:
        saved = {n: sys.modules.get(n) for n in names}
        try:
            if saved["reasoning_gym.utils"] is None:
                stand_in = types.ModuleType("reasoning_gym")
                stand_in.__path__ = [str(root)]
                sys.modules.setdefault("reasoning_gym", stand_in)
                sys.modules["reasoning_gym.utils"] = _load_file(
                    "reasoning_gym.utils", root / "utils.py"
                )
            modules = [_load_file(f"_tidal_gsm_symbolic_{i}", p) for i, p in enumerate(parts)]
        finally:
            for n, m in saved.items():
                if m is None:
                    sys.modules.pop(n, None)
                else:
                    sys.modules[n] = m
    gens = {}
    for module in modules:
        for attr in dir(module):
            if attr.startswith("generate_") and attr.removeprefix("generate_").isdigit():
                gens[int(attr.removeprefix("generate_"))] = getattr(module, attr)
    missing = sorted(set(TEMPLATES) - set(gens))
    if missing:
        raise ModuleNotFoundError(
            f"reasoning-gym at {root} lacks GSM-Symbolic generators {missing}; "
            f"task 'gsm_symbolic' needs version 0.1.25: {INSTALL}"
        )
    return gens


@register("gsm_symbolic")
@dataclass(kw_only=True)
class GSMSymbolic(Task):
    """Grade-school math word problems with a numeric answer (integer or decimal).

    Example::

        task = get_task("gsm_symbolic")
        prompt, reference = next(task.problems("train", seed=0))
        task.grade("... so she needs 12 hours.\\n#### 12", reference)
    """

    holdout: Literal["problem", "template"] = "problem"
    """What the eval split holds out: problem instances (by question text) or whole
    templates."""
    prompt_suffix: str = DEFAULT_SUFFIX
    """Appended to each question (reasoning-gym's own "Give the result as your final answer.
    Do not include units." is not used)."""
    strict: bool = False
    """Credit only an answer on a "#### N" line (or in \\boxed{}), not a bare last number."""

    _generators: dict[int, Callable[[random.Random, float], dict[str, Any]]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.holdout not in ("problem", "template"):
            raise ValueError(
                f"GSMSymbolic.holdout must be 'problem' or 'template', got {self.holdout!r}"
            )
        self._generators = load_generators()

    def problem(self, rng: random.Random) -> Problem:
        template = rng.choice(TEMPLATES)
        example = self._generators[template](rng, 1.0)
        return Problem(
            example["question"] + self.prompt_suffix,
            {"answer": str(example["answer"]), "template": template},
        )

    def key(self, problem: Problem) -> str:
        if self.holdout == "template":
            return f"template {problem.reference['template']}"
        return problem.prompt.removesuffix(self.prompt_suffix)

    def grade(self, completion: str, reference: Any) -> Grade:
        return grade_number(completion, reference["answer"], strict=self.strict)
