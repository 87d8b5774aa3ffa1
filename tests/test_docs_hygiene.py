"""The docs read as reference: no paths of one particular machine, no diary of work sessions
in the benchmark pages, every benchmark script indexed, and the benchmark pages' links
resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_PAGES = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "benchmarks").glob("*.md"))
BENCH_PAGES = sorted((ROOT / "benchmarks").glob("*.md"))

# Absolute paths that only exist on one machine. System locations every Linux host has
# (/dev/shm) and tidal's own default cache (~/.cache/tidal) are fine.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|tmp|root|home|Users)/")
SESSION_WORD = re.compile(r"\bsessions?\b", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", DOC_PAGES, ids=_name)
def test_no_machine_paths(page: Path) -> None:
    hits = [
        f"{_name(page)}:{n}: {line.strip()}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not hits, "machine-specific paths:\n" + "\n".join(hits)


@pytest.mark.parametrize("page", BENCH_PAGES, ids=_name)
def test_benchmark_pages_keep_no_diary(page: Path) -> None:
    hits = [
        f"{_name(page)}:{n}: {line.strip()}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if SESSION_WORD.search(line)
    ]
    assert not hits, "diary words ('session'):\n" + "\n".join(hits)


def test_every_benchmark_script_is_indexed() -> None:
    index = (ROOT / "benchmarks" / "README.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    missing = [s for s in scripts if f"| `{s}` |" not in index]
    assert scripts and not missing, f"benchmarks/README.md does not index {missing}"


@pytest.mark.parametrize("page", BENCH_PAGES, ids=_name)
def test_benchmark_page_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{_name(page)} links to missing files: {broken}"
