"""`tidal rl` on one machine: the launcher of every role, and the checks made before any
starts.

Lifecycle: `tidal rl --config NAME` runs `launch_local` in the launching process: it checks
the job (`check_rl_job`: nothing has started yet), trains or reuses the SFT warm start
(`prepare_policy`), starts an embedded store in its own threads, then starts the generator
processes (`tidal rl generator --store ADDR --index i ...`: tidal/rl/distributed/generator.py)
and the trainer (`tidal rl trainer --store ADDR ...`, through torchrun's launcher with
`--nproc N`: tidal/rl/distributed/trainer.py). It watches them: when one fails, it asks the
others to stop through the store and ends any left after a grace period; Ctrl-C does the
same. A generator still running rl.wait_timeout_s after the trainer finished is ended too,
and every role stops (SIGTERM) when the launcher itself dies (lifeline.py's
`die_with_launcher`, through TIDAL_RL_LAUNCHER in its environment). No role is left running.
The roles share nothing but the store (tidal/rl/distributed/coupling.py); each also runs
alone against a store address (`tidal store serve`) on a cluster.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tidal.rl.build import (
    check_routing_replay,
    check_task_text,
    describe_model,
    generator_device,
    make_task,
)
from tidal.rl.config import RLConfig
from tidal.rl.distributed.coupling import STOP, generator_name
from tidal.rl.distributed.generator_ranks import check_generator_layouts, generator_command
from tidal.rl.distributed.lifeline import LAUNCHER_ENV, start_role
from tidal.rl.distributed.mps import mps_daemon, role_env
from tidal.rl.warmstart import PolicySource, prepare_policy, resolve_policy

Log = Callable[[str], None]

CHILD_GRACE_S = 20.0
"""After asking the roles to stop, how long the launcher waits before it ends them."""


# -- checks before anything starts -------------------------------------------------------


def check_rl_job(cfg: RLConfig, *, log: Log = print) -> PolicySource | None:
    """Every check a user can fail that needs no trained warm start: the task, the policy's
    files, every generator's layout against the policy's architecture and, for policies
    that need no SFT, the tokenizer's cover of the task's text. Returns the resolved policy
    (None for an SFT warm start not trained yet).

    Raises:
        ValueError, FileNotFoundError: naming the field at fault.
    """
    task = make_task(cfg)
    if (warning := cfg.queue_warning()) is not None:
        log(f"tidal rl: warning: {warning}")
    gpus = torch.cuda.device_count() if generator_device(cfg).type == "cuda" else None
    if cfg.policy.kind == "sft":
        try:
            src = resolve_policy(cfg, log=log)
        except FileNotFoundError:  # trained by prepare_policy; its text checked after it
            from tidal.rl.warmstart import sft_run
            from tidal.train.trainer import model_args_for

            sft = sft_run(cfg)[0]
            where = f"the SFT warm start's model {sft.model.flavor!r}"
            check_generator_layouts(cfg, model_args_for(sft), cuda_devices=gpus, where=where)
            check_routing_replay(cfg, model_args_for(sft), where)
            return None
    else:
        src = resolve_policy(cfg, log=log)
    check_generator_layouts(cfg, src.args, cuda_devices=gpus, where=describe_model(src))
    check_routing_replay(cfg, src.args, describe_model(src))
    check_task_text(cfg, src, task)
    return src


def connect_store(address: str, cfg: RLConfig, *, token: str | None = None):
    """A store handle for `address` (`token`: the store's shared secret, if it has one).

    Raises:
        ValueError: the store does not answer (the message says where and how long)."""
    import tidal.store

    try:
        return tidal.store.connect(address, token=token, timeout=cfg.store.connect_timeout_s)
    except tidal.store.StoreError as e:
        raise ValueError(
            f"store.address {address!r} does not answer within store.connect_timeout_s="
            f"{cfg.store.connect_timeout_s:g} s ({e}); start one with `tidal store serve`"
        ) from e


# -- the launcher --------------------------------------------------------------------------


def run_local(config: str = "rl_addition", overrides: Sequence[str] = (), *, nproc: int = 1) -> int:
    """`tidal rl --config CONFIG OVERRIDES... --nproc N` from Python: every role on this
    machine (embedded store, generator processes, `nproc` trainer ranks). Returns the exit
    status (0: done; the run's folder holds metrics.jsonl, rl.png and the checkpoints).

    Raises:
        ValueError, FileNotFoundError: bad input, before any role starts.

    Example::

        from tidal.rl.distributed.launch import run_local
        run_local("rl_addition", ["--rl.steps", "10", "--job.output_dir", "outputs/rl10"])
    """
    from tidal.rl.configs import get_rl_config
    from tidal.train.config_parse import apply_overrides

    cfg = apply_overrides(get_rl_config(config), list(overrides))
    return launch_local(cfg, ["--config", config, *overrides], nproc=nproc)


def launch_local(
    cfg: RLConfig,
    role_argv: list[str],
    *,
    nproc: int = 1,
    token: str | None = None,
    log: Log = print,
) -> int:
    """`tidal rl`: every role on this machine, coupled by an embedded store (see the module
    docstring). `role_argv` is the config's command line (`--config NAME` and overrides),
    repeated for each role. Returns the exit status."""
    import tidal.store
    from tidal.rl.report import check_run_folder

    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    if check_run_folder(cfg, prog="tidal rl", log=log):  # finished: figures printed, no run
        return 0
    src = check_rl_job(cfg, log=log)
    if cfg.rl.mps and generator_device(cfg).type != "cuda":
        raise ValueError(
            "rl.mps shares a GPU between the roles, but the generators run "
            f"on {generator_device(cfg)}: set --rl.mps false"
        )
    if cfg.store.address:
        store = connect_store(cfg.store.address, cfg, token=token)
    else:
        store = tidal.store.connect(keep=cfg.store.keep)
    try:
        if src is None:
            prepare_policy(cfg, log=log)
            check_task_text(cfg, resolve_policy(cfg, log=log), make_task(cfg))
        with contextlib.ExitStack() as stack:
            mps = stack.enter_context(mps_daemon(log)) if cfg.rl.mps else {}
            return run_roles(cfg, store, role_argv, nproc=nproc, log=log, mps=mps)
    finally:
        store.close()


def run_roles(
    cfg: RLConfig,
    store: Any,
    role_argv: list[str],
    *,
    nproc: int = 1,
    log: Log = print,
    mps: dict[str, str] | None = None,
    popen: Callable[..., Any] = start_role,
) -> int:
    """Start the generators and the trainer (`nproc` ranks) as processes of this machine
    against `store` (a running store: its `address`), with `role_argv` (the config's
    command line) and `mps` (a CUDA MPS daemon's environment, `mps_daemon`) in their
    environment, then watch them until they end; returns the exit status. `popen(argv,
    env=...)` starts a process: `start_role` (Popen, the child ending with this process),
    or a stand-in in tests (the test seam: it records each role's command and
    environment)."""
    mps = mps or {}
    env = {**os.environ, "TIDAL_STORE": "", "PYTHONUNBUFFERED": "1", **mps}
    env[LAUNCHER_ENV] = str(os.getpid())
    env.setdefault("OMP_NUM_THREADS", "1")
    memory = cfg.store.policy_memory
    if memory == "auto":  # every role is on this machine: CUDA IPC when the trainer is on CUDA
        from tidal.train.job import resolve_device

        memory = "cuda" if resolve_device(cfg.job.device).type == "cuda" else "host"
    common = ["--store", store.address, *role_argv, "--store.policy_memory", memory]
    procs: dict[str, subprocess.Popen] = {}
    for i in range(cfg.generator.count):
        procs[generator_name(i)] = popen(
            generator_command(cfg, i, common), env=role_env(env, cfg.generator.sm_percent)
        )
    trainer_cmd = [sys.executable, "-m", "tidal", "rl", "trainer", *common]
    if nproc > 1:
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
        ]
        trainer_cmd = [*torchrun, "-m", "tidal", "rl", "trainer", *common]
    procs["trainer"] = popen(trainer_cmd, env=role_env(env, cfg.trainer.sm_percent))
    try:
        return _watch(procs, store, log, finish_s=cfg.rl.wait_timeout_s)
    except KeyboardInterrupt:
        log("tidal rl: interrupted; stopping every role")
        _put_stop(store, "the launcher was interrupted (Ctrl-C)")
        _end(procs, signal.SIGINT)
        return 130
    finally:
        _end(procs, signal.SIGTERM)


def _watch(procs: dict[str, subprocess.Popen], store: Any, log: Log, *, finish_s: float) -> int:
    """Wait for the roles. The trainer's failure stops the rest; a generator killed or failing
    is the trainer's to handle (it goes on with the others, or stops, naming it, when too few
    are left), unless no generator is left running at all or one exited with status 2 (a bad
    input, which every role shares, or a run that stopped). Once the trainer finished, the
    generators get `finish_s` to exit; those still running then are ended (the caller's
    `_end`). Returns the exit status."""
    told: set[str] = set()
    finished: float | None = None  # when the trainer exited 0
    while True:
        codes = {name: p.poll() for name, p in procs.items()}
        trainer = codes.pop("trainer")
        for name, code in codes.items():
            if code not in (None, 0, 2) and name not in told:
                told.add(name)
                log(f"tidal rl: {name} {_how(code)}; the trainer goes on with the others")
        failed = [(n, c) for n, c in codes.items() if c not in (None, 0)]
        bad = [(n, c) for n, c in failed if c == 2]
        if trainer not in (None, 0) or (trainer is None and (bad or len(failed) == len(codes))):
            if trainer not in (None, 0):
                code, why = trainer, f"the trainer {_how(trainer)}"
            elif bad:
                code, why = 2, f"{bad[0][0]} {_how(2)} (a bad input or a stopped run)"
            else:
                code = failed[0][1]
                why = "every generator exited: " + ", ".join(f"{n} {_how(c)}" for n, c in failed)
            log(f"tidal rl: {why}; stopping the other roles")
            _put_stop(store, why)
            _end(procs, None)
            return 130 if code in (130, -signal.SIGINT) else 1
        if trainer == 0 and all(c is not None for c in codes.values()):
            return 0
        if trainer == 0:
            finished = time.monotonic() if finished is None else finished
            if time.monotonic() - finished > finish_s:
                hung = [n for n, c in codes.items() if c is None]
                log(
                    f"tidal rl: the trainer finished but {', '.join(hung)} still ran "
                    f"{finish_s:g} s later (rl.wait_timeout_s); ending it"
                )
                _put_stop(store, f"the trainer finished; {', '.join(hung)} did not exit")
                return 0
        time.sleep(0.2)  # polling child processes, not synchronizing with them


def _how(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def _put_stop(store: Any, reason: str) -> None:
    try:
        if not store.exists(STOP):
            store.put_state_dict({"by": "the launcher", "reason": reason}, STOP)
    except Exception:  # documented fallback: the store is gone; the processes are ended below
        pass


def _end(procs: dict[str, subprocess.Popen], sig: int | None) -> None:
    """Signal the live roles (if `sig`), give them CHILD_GRACE_S to exit, then kill them."""
    live = [p for p in procs.values() if p.poll() is None]
    for p in live:
        if sig is not None:
            p.send_signal(sig)
    deadline = time.monotonic() + CHILD_GRACE_S
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
