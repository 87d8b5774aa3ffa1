"""Ctrl-C from a terminal (SIGINT to the whole process group) in each phase of `tidal train`.

In the training loop it stops after the current step on every rank, saves a checkpoint,
prints one line and no traceback, exit 130. During data preparation or the end-of-run sample
the run ends at once: "tidal train: interrupted" once (rank 0), no traceback, exit 130.

Each test signals only once it has read the line the run prints as the phase begins, and the
phase is made to last seconds (a corpus that takes seconds to encode, 100,000 steps, a greedy
sample of 2,000 tokens), so the signal lands inside it however loaded the machine is; the
asserts then check that it did (what the phase would have printed or written is missing).
"""

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests._signals import default_sigint
from tests.parallel.test_launch import _python_env


def _train_cmd(
    out: Path,
    nproc: int,
    corpus: Path,
    cache_dir: Path,
    *overrides: str,
    tokenizer: Path | None = None,
) -> list[str]:
    """`tidal train` of the tiny model on a jsonl corpus on `nproc` CPU ranks (FSDP over all of
    them) with a BPE of 512 tokens (trained, or `tokenizer`), stepping on and on and sampling
    nothing unless `overrides` (which win) say otherwise."""
    vocab = ["--data.tokenizer", str(tokenizer)] if tokenizer else ["--data.vocab_size", "512"]
    return [
        sys.executable,
        "-m",
        "tidal",
        "train",
        "--nproc",
        str(nproc),
        "--config",
        "debug",
        "--job.output_dir",
        str(out),
        "--job.device",
        "cpu",
        "--model.flavor",
        "tiny",
        "--model.vocab_size",
        "512",
        "--data.dataset",
        "jsonl",
        "--data.path",
        str(corpus),
        "--data.cache_dir",
        str(cache_dir),
        *vocab,
        "--training.steps",
        "100000",
        "--training.batch_size",
        "2",
        "--training.seq_len",
        "32",
        "--metrics.log_every",
        "1",
        "--metrics.val_every",
        "0",
        "--sample.max_new_tokens",
        "0",
        "--parallelism.dp_shard",
        str(nproc),
        *overrides,
    ]


def _ctrl_c(cmd: list[str], at: str, timeout: float = 240) -> tuple[int, str, str]:
    """Run `cmd` in a session of its own and, once it prints a line matching the regex `at`,
    send SIGINT to its process group as a terminal's Ctrl-C does. Returns the exit status and
    the output (stdout and stderr) before and after the signal.

    Nothing waits past `timeout` seconds in all: then the process group is killed and the test
    fails (torchrun's ranks, in sessions of their own, may outlive it; a daemon thread reads
    the output, so nothing waits for them)."""
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", **_python_env()}
    env["PYTHONUNBUFFERED"] = "1"  # each line as it is printed, as on a terminal
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=default_sigint,
    )
    stdout = proc.stdout
    assert stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stdout:
            lines.put(line)
        lines.put(None)  # end of output

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    before: list[str] = []
    after: list[str] = []
    signalled = False
    try:
        while (line := lines.get(timeout=max(deadline - time.monotonic(), 0.1))) is not None:
            (after if signalled else before).append(line)
            if not signalled and re.match(at, line):
                os.killpg(proc.pid, signal.SIGINT)
                signalled = True
        code = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except (queue.Empty, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"no exit within {timeout}s:\n" + "".join(before) + "".join(after))
    stdout.close()
    assert signalled, f"no line matching {at!r}:\n" + "".join(before)
    return code, "".join(before), "".join(after)


@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_stops_after_the_step_saves_and_exits_quietly(
    nproc, tmp_path, text_corpus, cache_dir
):
    out = tmp_path / "out"
    cmd = _train_cmd(
        out,
        nproc,
        text_corpus,
        cache_dir,
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "100000",
    )
    code, before, rest = _ctrl_c(cmd, at=r"step +2/")
    assert code == 130, before + rest
    assert "Traceback" not in rest and "Error" not in rest, rest
    stopped = [x for x in rest.splitlines() if x.startswith("interrupted: stopped after step")]
    assert len(stopped) == 1, rest  # one line, from rank 0
    step = int(stopped[0].split("step ")[1].split("/")[0])
    assert (out / "checkpoint" / f"step-{step}" / "COMPLETE").is_file()
    logged = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, step + 1))


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory) -> Path:
    """20,000 documents counting up, 100 numbers each: 15 MB, read and split in a fraction of a
    second, but 15 million tokens (tidal's BPE spells numbers digit by digit), which take
    tokenizers 6 s to encode on two cores (12 s on one); the encoding sees a Ctrl-C after each
    `encode_batch` call of 1,024 documents (0.3 s)."""
    path = tmp_path_factory.mktemp("long_corpus") / "numbers.jsonl"
    path.write_text(
        "".join(
            json.dumps({"text": " ".join(map(str, range(i, i + 100)))}) + "\n"
            for i in range(0, 2_000_000, 100)
        )
    )
    return path


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory, text_corpus) -> Path:
    """A BPE trained on the small corpus, so that data preparation goes straight to encoding."""
    from tidal.train.data.tokenizer import train_bpe

    docs = [json.loads(x)["text"] for x in text_corpus.read_text().splitlines()]
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe(docs, 512, path.parent / "cache").save(path)
    return path


@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_in_data_preparation_exits_at_once(nproc, tmp_path, long_corpus, tokenizer_file):
    out, cache = tmp_path / "out", tmp_path / "cache"  # a fresh cache: nothing encoded yet
    cmd = _train_cmd(out, nproc, long_corpus, cache, tokenizer=tokenizer_file)
    # Printed once the documents are read and split; encoding the training split comes next.
    code, before, after = _ctrl_c(cmd, at=r"data: loaded [\d,]+ jsonl documents")
    assert code == 130, before + after
    assert after.splitlines() == ["tidal train: interrupted"], after  # rank 0's, and nothing else
    assert not list(cache.rglob("tokens.npy"))  # the encoding never finished
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_in_the_final_sample_exits_at_once(nproc, tmp_path, text_corpus, cache_dir):
    out = tmp_path / "out"
    # The debug model (context 2,048) takes ms a token on a CPU, and greedy decoding of the
    # seeded model (the same tokens every run) soon repeats a cycle without EOS: the sample
    # runs all 2,000 tokens, 10 s in one process on two cores, 80 s on two ranks.
    cmd = _train_cmd(
        out,
        nproc,
        text_corpus,
        cache_dir,
        "--model.flavor",
        "debug",
        "--training.steps",
        "1",
        "--sample.max_new_tokens",
        "2000",
        "--sample.temperature",
        "0",
    )
    code, before, after = _ctrl_c(cmd, at=r"sampling: ")
    assert code == 130, before + after
    assert after.splitlines() == ["tidal train: interrupted"], after
    assert "step      1/1 loss" in before
    assert not (out / "sample.txt").exists()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
