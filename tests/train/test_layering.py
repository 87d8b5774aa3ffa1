"""Dependency direction (DESIGN.md): tidal/train never imports tidal/rl or the generation
engine (tidal/generate), neither in its source nor when it runs (the end-of-run sample is
`tidal train`'s, after the trainer's loop)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tidal.train
from tests.parallel.test_layering import _imported_modules

TRAIN_DIR = Path(tidal.train.__file__).parent
REPO = TRAIN_DIR.parents[1]


def test_train_sources_import_nothing_from_rl():
    files = sorted(TRAIN_DIR.rglob("*.py"))
    assert len(files) > 10, TRAIN_DIR
    offenders = {
        f"{path.relative_to(TRAIN_DIR)}: {name}"
        for path in files
        for name in _imported_modules(path)
        if name == "tidal.rl" or name.startswith("tidal.rl.")
    }
    assert not offenders, f"tidal/train imports tidal/rl: {sorted(offenders)}"


RUN = """
import sys, tempfile
from types import SimpleNamespace
import torch
from tidal.train.config_parse import apply_overrides
from tidal.train.configs import get_config
from tidal.train.data import Batch, DataBundle
from tidal.train.loss import CrossEntropy
from tidal.train.trainer import Trainer

cfg = apply_overrides(get_config("debug"), [
    "--job.output_dir", tempfile.mkdtemp(), "--job.device", "cpu", "--model.flavor", "tiny",
    "--training.mixed_precision", "fp32", "--training.seq_len", "16", "--training.steps", "2",
    "--metrics.val_every", "0"])
tok = SimpleNamespace(vocab_size=512, bos_id=0, eos_id=1)
trainer = Trainer(cfg, data=DataBundle(tokenizer=tok, train=None, val=None), log=print)
ids = torch.randint(0, 512, (2, 17))
batch = Batch(input_ids=ids[:, :-1], labels=ids[:, 1:], document_ids=torch.zeros(2, 16).int())
trainer.train_step([batch], 32)
trainer.train_step([batch], 32, loss=CrossEntropy())
trainer.logprobs(batch)
trainer.close()
above = (["tidal", "rl"], ["tidal", "generate"])
loaded = sorted(m for m in sys.modules if m.split(".")[:2] in above)
print("RL MODULES", loaded)
"""


def test_running_the_trainer_loads_no_rl_module(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", RUN], cwd=REPO, capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RL MODULES []" in out.stdout, out.stdout[-2000:]
