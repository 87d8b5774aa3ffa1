"""`tidal train --nproc N` launches torchrun; only rank 0 prints and writes metrics."""

import json
import subprocess
import sys


def test_nproc_launch_trains_and_logs_once(tmp_path, text_corpus, cache_dir):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "tidal",
        "train",
        "--nproc",
        "2",
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
        str(text_corpus),
        "--data.cache_dir",
        str(cache_dir),
        "--data.vocab_size",
        "512",
        "--training.steps",
        "4",
        "--training.batch_size",
        "2",
        "--training.seq_len",
        "32",
        "--parallelism.dp_shard",
        "2",
        "--metrics.log_every",
        "2",
        "--metrics.val_every",
        "4",
        "--metrics.val_batches",
        "1",
        "--sample.max_new_tokens",
        "8",
    ]
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**env, **_python_env()}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("step      4/4 loss") == 1
    assert "world 2 (dp_shard=2)" in proc.stdout
    assert proc.stdout.count("sample:") == 1  # sampled on both ranks, printed by rank 0
    assert (out / "sample.txt").read_text().startswith("ROMEO:")
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4]
    assert any("val_loss" in r for r in records)
    last = [r for r in records if "loss" in r][-1]
    assert last["tokens_per_s"] == 2 * last["tokens_per_s_per_device"]


def _python_env():
    import os

    keep = (
        "HOME",
        "PYTHONPATH",
        "VIRTUAL_ENV",
        "TMPDIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "TIDAL_CACHE_DIR",
    )
    return {k: os.environ[k] for k in keep if k in os.environ}
