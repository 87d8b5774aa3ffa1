"""docs/rl.md's examples run as written: every block fenced ```python, in order, in one
namespace (blocks fenced ```py are signatures, not run)."""

import re
from pathlib import Path

from tidal.rl.envs import ENVS
from tidal.rl.tasks import TASKS

DOC = Path(__file__).parents[2] / "docs" / "rl.md"


def test_rl_doc_examples_run(capsys):
    blocks = re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), re.DOTALL | re.MULTILINE)
    assert len(blocks) >= 4
    before, envs_before = dict(TASKS), dict(ENVS)
    try:
        namespace: dict = {"__name__": "docs_rl"}
        for i, code in enumerate(blocks):
            exec(compile(code, f"{DOC}:block{i}", "exec"), namespace)  # our own docs
    finally:
        TASKS.clear()
        TASKS.update(before)
        ENVS.clear()
        ENVS.update(envs_before)
    assert "Grade(reward=1.0, answer='4691', format_ok=True)" in capsys.readouterr().out
