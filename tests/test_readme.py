"""README.md stays a short front door that tells the truth: its code layout names files that
exist and covers every package, and its Python examples run as written."""

import re
from pathlib import Path

from tidal.train.config import Config
from tidal.train.configs import CONFIGS, sft_addition

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def layout_paths() -> list[str]:
    """The first word of every line of the "Code layout" block."""
    section = README.split("## Code layout", 1)[1]
    block = re.search(r"^```\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    assert block, "README.md has no code block under '## Code layout'"
    return [line.split()[0] for line in block.group(1).splitlines() if line.strip()]


def _smaller_sft_addition() -> Config:
    cfg = sft_addition()
    cfg.data.num_problems = 2_000
    cfg.training.batch_size = 4
    return cfg


def test_readme_is_short():
    assert README.count("\n") <= 200, "README.md is over 200 lines: details go to docs/"


def test_code_layout_names_files_that_exist():
    missing = [p for p in layout_paths() if not (ROOT / p).exists()]
    assert not missing, f"README.md's code layout names paths that do not exist: {missing}"


def test_code_layout_covers_every_package():
    named = layout_paths()
    packages = sorted(
        str(p.parent.relative_to(ROOT)) + "/" for p in (ROOT / "tidal").rglob("__init__.py")
    )
    uncovered = [d for d in packages if not any(n.startswith(d) for n in named)]
    assert not uncovered, f"README.md's code layout names nothing in {uncovered}"


def test_python_examples_run(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"^```python\n(.*?)^```$", README, re.DOTALL | re.MULTILINE)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    # The examples run as written, on the registered configs they name, made smaller where
    # the example does not look: the training example's sft_addition generates, tokenizes
    # and batches fewer problems (its data, tokenizer and 10 steps still all run; the whole
    # config's data is built by the slow test_sft_addition_reaches_a_useful_accuracy).
    monkeypatch.setitem(CONFIGS, "sft_addition", _smaller_sft_addition)
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md:python-block-{i}", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "[0, 1]" in out  # the store example's versions
