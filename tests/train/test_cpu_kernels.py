"""job.cpu_kernels=portable: torch's and MKL's AVX2 kernels, whatever the CPU would pick."""

import os
import platform
import subprocess
import sys

import pytest
import torch

from tidal.train.config import JobConfig
from tidal.train.cpu_kernels import PORTABLE_ENV, apply_cpu_kernels, pin_portable_kernels

x86_avx2 = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64")
    or "avx2" not in open("/proc/cpuinfo").read().split(),
    reason="portable kernels are the AVX2 code of x86-64 CPUs",
)

# A few training steps of a small model: matrix products (MKL), attention, norms and the
# loss (torch's own kernels). Prints a hash of the weights after them.
TRAIN = """
import dataclasses, hashlib, sys
import torch
from tidal.train.cpu_kernels import pin_portable_kernels
if sys.argv[1] == "pin":
    assert pin_portable_kernels()
from tidal.models import Transformer, get_flavor
torch.manual_seed(0)
args = dataclasses.replace(get_flavor("debug"), vocab_size=128, n_layers=2)
model = Transformer(args)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
tokens = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
for _ in range(3):
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
print(torch.backends.cpu.get_cpu_capability(), h.hexdigest())
"""


def _start(mode: str, **env: str) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if k not in PORTABLE_ENV}
    return subprocess.Popen(
        [sys.executable, "-c", TRAIN, mode],
        env={**clean, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen) -> list[str]:
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, stderr
    return stdout.split()[-2:]


@x86_avx2
def test_pinned_kernels_do_not_follow_what_the_cpu_offers():
    # The libraries' own choices, narrowed as a CPU with less would narrow them: pinned, the
    # weights come out the same bits. The four processes are independent (each its own
    # environment and threads): they run side by side, not one after another.
    procs = [
        _start("pin"),
        _start("pin", MKL_ENABLE_INSTRUCTIONS="AVX2", OMP_NUM_THREADS="1"),
        _start("pin", ONEDNN_MAX_CPU_ISA="AVX2", OMP_NUM_THREADS="2"),
        # The same environment set by hand, before the process starts, is the same arithmetic.
        _start("auto", **PORTABLE_ENV),
    ]
    try:
        (capability, pinned), mkl, onednn, by_hand = (_result(p) for p in procs)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert capability == "AVX2"
    assert mkl[1] == pinned
    assert onednn[1] == pinned
    assert by_hand == ["AVX2", pinned]


@x86_avx2
def test_too_late_in_a_process_says_so_and_leaves_the_environment(monkeypatch):
    for name in PORTABLE_ENV:
        monkeypatch.delenv(name, raising=False)
    torch.ones(2).add_(1)  # this process chose its kernels already
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        pytest.skip("this CPU's best kernels are the AVX2 ones: nothing to pin")
    lines: list[str] = []
    assert not pin_portable_kernels(log=lines.append)
    assert "a tensor operation ran before the config was read" in lines[0]
    assert not set(PORTABLE_ENV) & set(os.environ)  # children must not differ from it


def test_a_conflicting_setting_is_kept_and_named(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    lines: list[str] = []
    if platform.machine() not in ("x86_64", "AMD64"):
        assert not pin_portable_kernels(log=lines.append)
        assert "x86-64 only" in lines[0]
        return
    assert not pin_portable_kernels(log=lines.append)
    assert "ATEN_CPU_CAPABILITY=avx512 is set" in lines[0]
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx512"


def test_auto_leaves_the_process_alone(monkeypatch):
    for name in PORTABLE_ENV:
        monkeypatch.delenv(name, raising=False)
    lines: list[str] = []
    apply_cpu_kernels(JobConfig(), log=lines.append)
    assert lines == [] and not set(PORTABLE_ENV) & set(os.environ)


def test_a_bad_value_names_the_field():
    with pytest.raises(ValueError, match="job.cpu_kernels must be one of auto, portable"):
        JobConfig(cpu_kernels="fast")  # type: ignore[arg-type]
