"""Ctrl-C from a terminal (SIGINT to the whole process group): `tidal train` stops after the
current step on every rank, saves a checkpoint, prints one line and no traceback, exit 130."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.parallel.test_launch import _python_env


@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_stops_after_the_step_saves_and_exits_quietly(nproc, tmp_path, text_corpus,
                                                            cache_dir):  # fmt: skip
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "tidal", "train", "--nproc", str(nproc), "--config", "debug",
        "--job.output_dir", str(out), "--job.device", "cpu", "--model.flavor", "tiny",
        "--model.vocab_size", "512", "--data.dataset", "jsonl", "--data.path", str(text_corpus),
        "--data.cache_dir", str(cache_dir), "--data.vocab_size", "512",
        "--training.steps", "100000", "--training.batch_size", "2", "--training.seq_len", "32",
        "--metrics.log_every", "1", "--metrics.val_every", "0", "--sample.max_new_tokens", "0",
        "--checkpoint.enable", "true", "--checkpoint.interval", "100000",
        "--parallelism.dp_shard", str(nproc),
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", **_python_env()}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # wait until training runs, then Ctrl-C (the terminal's way)
        seen.append(line)
        if line.startswith("step      2/"):
            os.killpg(proc.pid, signal.SIGINT)
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 130, "".join(seen) + rest
    assert "Traceback" not in rest and "Error" not in rest, rest
    stopped = [x for x in rest.splitlines() if x.startswith("interrupted: stopped after step")]
    assert len(stopped) == 1, rest  # one line, from rank 0
    step = int(stopped[0].split("step ")[1].split("/")[0])
    assert (out / "checkpoint" / f"step-{step}" / "COMPLETE").is_file()
    logged = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, step + 1))
