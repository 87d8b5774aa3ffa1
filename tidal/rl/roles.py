"""The RL roles as processes: the trainer, the generators, and the local launcher.

Lifecycle:
- `tidal rl --config NAME` (one machine) runs `launch_local` in the launching process: it
  checks the job (`check_rl_job`: nothing has started yet), trains or reuses the SFT warm
  start (`prepare_policy`), starts an embedded store in its own threads, then starts the
  generator processes (`tidal rl generator --store ADDR --index i ...`) and the trainer
  (`tidal rl trainer --store ADDR ...`, through torchrun's launcher with `--nproc N`). It
  watches them: when one fails, it asks the others to stop through the store and ends any
  left after a grace period; Ctrl-C does the same. No role is left running.
- `run_trainer` (every trainer rank): builds the tidal Trainer (no data pipeline, the warm
  start loaded through the checkpoint code), clears an earlier run's keys, announces the first
  step (`control/start`), publishes version 0 and runs `train_loop`; rank 0 logs.
- `run_generator` (each generator process, or each rank of a tensor-parallel generator:
  tidal/rl/layouts.py): builds the model from the policy's architecture in the generator's
  layout (its weights come from the store only, each rank reading its own shards), warms
  up its Generator (compiles and CUDA graphs; its heartbeats say it is ready only then, so
  the trainer's steps never wait for them), waits for `control/start` and runs
  `generate_loop`; rank 0 alone beats and puts rollouts.
The roles share nothing but the store (tidal/rl/coupling.py); each also runs alone against a
store address (`tidal store serve`) on a cluster.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tidal.rl.build import (
    build_generator,
    build_trainer,
    check_task_text,
    generator_device,
    generator_dtype,
    make_policy,
    make_task,
    publish_dtype,
    reference_weights,
    trainer_seq_len,
    trainer_weights,
    warm_up_generator,
)
from tidal.rl.config import RLConfig
from tidal.rl.coupling import (
    DONE,
    POLICY,
    START,
    STOP,
    Leaving,
    Link,
    NotYet,
    RoleStopped,
    generator_name,
)
from tidal.rl.layouts import (
    check_generator_layouts,
    generator_command,
    join_generator_group,
    leave_generator_group,
)
from tidal.rl.mps import mps_daemon, role_env
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
            return None
    else:
        src = resolve_policy(cfg, log=log)
    check_generator_layouts(cfg, src.args, cuda_devices=gpus, where=_model_name(src))
    check_task_text(cfg, src, task)
    return src


def _model_name(src: PolicySource) -> str:
    return f"the policy's model ({src.describe})" if src.describe else "the policy's model"


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


# -- the trainer ---------------------------------------------------------------------------


def run_trainer(cfg: RLConfig, store: Any, *, dist_info=None, log: Log = print) -> dict:
    """The trainer role (every rank). Returns the summary rank 0 printed ({} on others)."""
    import torch.distributed as dist

    from tidal.parallel.launch import DistInfo
    from tidal.rl.loop import TrainerSide, train_loop
    from tidal.rl.report import Report

    info = dist_info or DistInfo()
    main = info.is_main
    src = resolve_policy(cfg, log=log)
    check_task_text(cfg, src, make_task(cfg))
    from tidal.rl.membership import Members

    # The generators are members that come and go (tidal/rl/membership.py), not watched roles.
    link = Link(store, "trainer", watch=[], loop=cfg.rl, beat=main, log=log)
    trainer = build_trainer(cfg, src, dist_info=info, log=log)
    report = None
    members: Members | None = None
    try:
        first = trainer.step
        barrier = dist.new_group(backend="gloo") if info.world_size > 1 else None
        if main:
            _clear_run(store)
            link.start()
        if barrier is not None:
            dist.barrier(group=barrier)
        dtype, writers = publish_dtype(cfg), info.world_size
        memory = cfg.store.policy_memory
        if memory == "auto":  # `tidal rl` resolves it for the roles it starts
            memory = "cuda" if trainer.device.type == "cuda" and not cfg.store.address else "host"

        def publish(version: int):
            future = store.put_state_dict_async(
                trainer_weights(trainer),
                POLICY,
                version=version,
                writers=writers,
                dtype=dtype,
                memory=memory,
            )

            def stop_on_failure(f) -> None:
                # The loop reads the put's result only after the next rollouts, which the
                # generators cannot make without this version: stop every role now, naming
                # the error, instead of all of them waiting out rl.wait_timeout_s.
                if not f.cancelled() and f.exception() is not None:
                    e = f.exception()
                    link.stop(
                        f"the trainer (rank {info.rank}) failed to publish policy "
                        f"version {version}: {type(e).__name__}: {e}"[:500]
                    )

            future.add_done_callback(stop_on_failure)
            return future

        dp_rank = trainer.mesh["dp"].get_local_rank() if trainer.mesh is not None else 0
        members = Members(store, cfg, log=log) if main else None
        side = TrainerSide(
            trainer=trainer,
            publish=publish,
            dp_rank=dp_rank,
            dp_world=trainer.dims.dp,
            is_main=main,
            seq_len=trainer_seq_len(cfg, src) if trainer.dims.pp > 1 else None,
            reference=reference_weights(trainer, cfg),
            members=members,
        )
        if members is not None:
            members.start()
        if main:
            report = Report(cfg, first_step=first, resumed=first > 0, log=log)
            store.put_state_dict({"step": first, "steps": cfg.rl.steps}, START, version=0)
            link.follow_run()
            log(
                f"trainer: {src.describe}; steps {first + 1}..{cfg.rl.steps}, "
                f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} samples a "
                f"step over {cfg.generator.count} generator(s), {cfg.rl.mode} mode"
                + (
                    f" (max_staleness {cfg.rl.max_staleness}, queue {cfg.queue_slots()} "
                    f"batch(es) per generator, {cfg.rl.batches_in_flight} in flight)"
                    if cfg.rl.mode == "async"
                    else ""
                )
            )
        train_loop(
            side, link, cfg, first_step=first, log_record=report.log if report else lambda r: None
        )
        summary = report.finish() if report else {}
        if main:
            store.put_state_dict({"ok": True}, DONE, version=0)
        return summary
    except BaseException as e:
        if main:
            link.stop(_why(e, "the trainer"))
        raise
    finally:
        if members is not None:
            members.close()
        if report is not None:
            report.close()
        link.close()
        trainer.close()


def _clear_run(store: Any) -> None:
    """Delete an earlier run's keys (one run per store at a time)."""
    for key in store.keys():
        if key == POLICY or key.startswith(("rollouts/", "control/")) or key == "eval":
            store.delete(key)


def _why(e: BaseException, role: str) -> str:
    if isinstance(e, KeyboardInterrupt):
        return f"{role} was interrupted (Ctrl-C)"
    return f"{role} failed: {type(e).__name__}: {e}"[:500]


# -- a generator ---------------------------------------------------------------------------


def run_generator(
    cfg: RLConfig, store: Any, *, index: int, dist_info=None, log: Log = print
) -> None:
    """Generator `index`'s role (in each of its ranks; `dist_info`: torchrun's, for a
    tensor-parallel generator): until the trainer is done."""
    from tidal.parallel.launch import DistInfo

    if not 0 <= index < MAX_GENERATORS:
        raise ValueError(f"--index must be in 0..{MAX_GENERATORS - 1}, got {index}")
    info = dist_info or DistInfo()
    log = log if info.is_main else _quiet
    task = make_task(cfg)
    src = resolve_policy(cfg, log=log)
    device = generator_device(cfg, info.local_rank)
    gpus = torch.cuda.device_count() if device.type == "cuda" else None
    check_generator_layouts(cfg, src.args, cuda_devices=gpus, where=_model_name(src))
    mesh = join_generator_group(cfg, index, info, device)
    try:
        _generate_role(cfg, store, src, task, index=index, info=info, mesh=mesh, log=log)
    finally:
        if mesh is not None:  # the model is gone with _generate_role's frame
            del mesh
            leave_generator_group()


def _generate_role(
    cfg: RLConfig,
    store: Any,
    src: PolicySource,
    task: Any,
    *,
    index: int,
    info: Any,
    mesh: Any,
    log: Log,
) -> None:
    from tidal.rl.async_generator import generate_loop_async
    from tidal.rl.layouts import agree_start
    from tidal.rl.loop import generate_loop
    from tidal.rl.membership import leave

    name, main = generator_name(index), info.is_main
    if main:  # the beating rank speaks for the generator
        _check_index_free(store, name, cfg)
    # Beating from the start (alive), ready once warmed up (then the trainer counts it).
    link = Link(store, name, watch=["trainer"], loop=cfg.rl, beat=main, log=log, ready=False)
    link.start()

    def on_sigterm(signum, frame) -> None:  # leave at the next wait (after a batch in progress)
        link.leaving = "it was asked to leave (SIGTERM)"

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        gen = build_generator(cfg, src, mesh=mesh, local_rank=info.local_rank)
        warm_up_generator(gen, cfg, index, log=log)
        link.set_ready()
        policy = make_policy(cfg, src, gen)
        start = link.wait("the trainer's start", lambda seconds: _start_of(link, seconds))
        link.follow_run()
        # A generator joining a running job starts from the newest committed version.
        first = max(
            [start["step"], *store.versions(POLICY)] if store.exists(POLICY) else [start["step"]]
        )
        first, link.ident = agree_start(first, link.ident, gen.model)
        where = str(gen.device) if mesh is None else f"{info.world_size} ranks (tp) on {gen.device}"
        share = (
            f"{cfg.prompts_of(index)} prompts a batch"
            if cfg.rl.mode == "async"
            else ("its share of the prompts")
        )
        log(
            f"{name}: on {where} ({generator_dtype(cfg)}), from policy version {first} to "
            f"{cfg.rl.steps}, {share}"
        )
        loop = generate_loop_async if cfg.rl.mode == "async" else generate_loop
        loop(policy, task, link, cfg, index=index, first_step=first, log=log, main=main)
        link.wait_version(DONE, 0, "the trainer to finish")
    except Leaving as e:
        log(f"{name}: leaving the job: {e}; the trainer goes on with the others")
        if main:
            leave(link, index, str(e))
    except RoleStopped:
        raise  # another role stopped the run, or the trainer died: nothing to tell
    except BaseException as e:
        # This generator's own failure: it leaves, saying why; the run goes on with the others
        # (and stops, naming this, when too few are left). A rank past the first just ends:
        # torchrun then ends its peers, and the trainer sees the generator lost.
        if main:
            leave(link, index, _why(e, name))
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        link.close()


def _quiet(line: str) -> None:
    """The log of a generator's ranks past the first (rank 0 prints for the generator)."""
    return None


def _start_of(link: Link, seconds: float) -> dict:
    """The run's control/start, once the trainer beats: a control/start left by an earlier
    run on the same store is not this run's (the trainer clears it before it beats)."""
    if not link.beating("trainer"):
        time.sleep(seconds / 4)
        raise NotYet
    return link.store.get_state_dict(START, version=0, wait=seconds)


MAX_GENERATORS = 10_000
"""Generator indices are 0..MAX_GENERATORS - 1."""


def _check_index_free(store: Any, name: str, cfg: RLConfig) -> None:
    """Refuse an index whose generator is running: its heartbeat still advances.

    Raises:
        ValueError: naming the index."""
    from tidal.store.errors import KeyNotFoundError, VersionNotFoundError

    key = Link.key(name)
    if not store.exists(key):
        return
    try:
        first = store.versions(key)[-1]
        deadline = time.monotonic() + 2.5 * cfg.rl.heartbeat_s
        while time.monotonic() < deadline:  # two heartbeats: does it still beat?
            if store.versions(key)[-1] != first:
                raise ValueError(
                    f"{name} is already running in this job (its heartbeat "
                    f"{key} advances); give this one another --index"
                )
            time.sleep(cfg.rl.heartbeat_s / 4)
    except (KeyNotFoundError, VersionNotFoundError, IndexError):
        return  # it left meanwhile


# -- the local launcher ----------------------------------------------------------------------


def run_local(config: str = "rl_addition", overrides: Sequence[str] = (), *, nproc: int = 1) -> int:
    """`tidal rl --config CONFIG OVERRIDES... --nproc N` from Python: every role on this
    machine (embedded store, generator processes, `nproc` trainer ranks). Returns the exit
    status (0: done; the run's folder holds metrics.jsonl, rl.png and the checkpoints).

    Raises:
        ValueError, FileNotFoundError: bad input, before any role starts.

    Example::

        from tidal.rl.roles import run_local
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

    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
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
            return _run_roles(cfg, store, role_argv, nproc, log, mps)
    finally:
        store.close()


def _run_roles(
    cfg: RLConfig, store: Any, role_argv: list[str], nproc: int, log: Log, mps: dict[str, str]
) -> int:
    env = {**os.environ, "TIDAL_STORE": "", "PYTHONUNBUFFERED": "1", **mps}
    env.setdefault("OMP_NUM_THREADS", "1")
    memory = cfg.store.policy_memory
    if memory == "auto":  # every role is on this machine: CUDA IPC when the trainer is on CUDA
        from tidal.train.job import resolve_device

        memory = "cuda" if resolve_device(cfg.job.device).type == "cuda" else "host"
    common = ["--store", store.address, *role_argv, "--store.policy_memory", memory]
    procs: dict[str, subprocess.Popen] = {}
    for i in range(cfg.generator.count):
        procs[generator_name(i)] = subprocess.Popen(
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
    procs["trainer"] = subprocess.Popen(trainer_cmd, env=role_env(env, cfg.trainer.sm_percent))
    try:
        return _watch(procs, store, log)
    except KeyboardInterrupt:
        log("tidal rl: interrupted; stopping every role")
        _put_stop(store, "the launcher was interrupted (Ctrl-C)")
        _end(procs, signal.SIGINT)
        return 130
    finally:
        _end(procs, signal.SIGTERM)


def _watch(procs: dict[str, subprocess.Popen], store: Any, log: Log) -> int:
    """Wait for the roles. The trainer's failure stops the rest; a generator killed or failing
    is the trainer's to handle (it goes on with the others, or stops, naming it, when too few
    are left), unless no generator is left running at all or one exited with status 2 (a bad
    input, which every role shares, or a run that stopped). Returns the exit status."""
    told: set[str] = set()
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


def output_path(cfg: RLConfig, name: str) -> Path:
    return Path(cfg.job.output_dir) / name
