"""Portable CPU arithmetic: the same bits on every x86-64 CPU with AVX2.

torch picks its CPU kernels by what the processor offers: AVX-512 code on one machine, AVX2 on
another, and MKL (its matrix products) does the same. The kernels round differently, so one
run's numbers drift apart between CPU models, and a training run is chaotic enough for the
drift to change its result: `make demo`'s warm start gave 52.0% on one machine and 49.5% on
another before this (docs/rl.md).

`job.cpu_kernels = "portable"` pins both to their AVX2 code, which every x86-64 CPU since 2013
runs: torch's own kernels through `ATEN_CPU_CAPABILITY=avx2`, MKL's through its conditional
numerical reproducibility mode (`MKL_CBWR=AVX2`). torch reads both once, at the first
operation that needs them, so they must be set before the first tensor operation of the
process; `tidal train`, `tidal rl` and `python -m tidal.rl.grpo` set them right after reading
the config, and the processes they start inherit them. On an AMD EPYC (AVX-512) they cost
`make demo`'s SFT at most 5% against the AVX-512 kernels.

What stays machine-specific: other architectures (ARM has neither setting), another torch
version, and CUDA.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Any

PORTABLE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}
"""The environment that pins torch's and MKL's CPU kernels to their AVX2 code."""


def apply_cpu_kernels(job: Any, *, log: Callable[[str], None] = print) -> None:
    """What an entry point calls once its config is read: pins the kernels when
    `job.cpu_kernels` (a JobConfig) is "portable"."""
    if job.cpu_kernels == "portable":
        pin_portable_kernels(log=log)


def pin_portable_kernels(*, log: Callable[[str], None] = print) -> bool:
    """Set `PORTABLE_ENV` in this process's environment (kept for the processes it starts)
    and check that torch took it. Returns True when the kernels are pinned; otherwise logs
    one line saying why not (another architecture, a conflicting setting of the user's, or a
    tensor operation that ran before this call: the environment is then left as it was) and
    returns False: the run goes on with the kernels it has, its figures repeatable on this
    machine only."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        log(f"job.cpu_kernels=portable: no effect on {platform.machine()} (x86-64 only)")
        return False
    added = []
    for name, value in PORTABLE_ENV.items():
        have = os.environ.get(name)
        if have is None:
            os.environ[name] = value
            added.append(name)
        elif have.upper() != value.upper():
            log(
                f"job.cpu_kernels=portable: {name}={have} is set in the environment; "
                f"kept, so results may differ from other machines' ({name}={value} pins them)"
            )
            return False
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        for name in added:  # too late for this process: its children must not differ from it
            del os.environ[name]
        log(
            f"job.cpu_kernels=portable: torch runs its {capability} kernels in this process (a "
            "tensor operation ran before the config was read, or the CPU has no AVX2); results "
            "may differ "
            f"from other machines'. Set {_shell(PORTABLE_ENV)} before starting it."
        )
        return False
    return True


def _shell(env: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items())
