"""`tidal rl`: RL post-training, every role on this machine or each role on its own.

    tidal rl [--config NAME|MODULE:FUNCTION] [--help] [--print-config] [--nproc N]
             [--prepare] [--section.field VALUE ...]
    tidal rl trainer --store tcp://HOST:PORT [--config NAME] [...]     (under torchrun for N ranks)
    tidal rl generator --store tcp://HOST:PORT --index I [--config NAME] [...]

The first form starts an embedded store, trains the SFT warm start if it is not cached,
then runs the generators and the trainer (`--nproc` ranks) as processes of this machine
(tidal/rl/distributed/launch.py). `--prepare` only trains the warm start. The role forms join a
store started elsewhere (`tidal store serve`); every role of a run gets the same config and
overrides. Environment: TIDAL_STORE_TOKEN (the store's shared secret, for non-loopback stores),
TIDAL_CACHE_DIR (the default of policy.cache_dir), torchrun's RANK / LOCAL_RANK / WORLD_SIZE.
Errors a user can cause print one line and exit with status 2; Ctrl-C stops every
role (status 130).
"""

from __future__ import annotations

import argparse
import os
import sys

ROLES = ("trainer", "generator")


def main(argv: list[str]) -> int:
    role = argv[0] if argv and argv[0] in ROLES else None
    rest = argv[1:] if role else argv
    prog = f"tidal rl {role}" if role else "tidal rl"
    from tidal.parallel.launch import DistInfo

    dist_info = DistInfo.from_env()

    def fail(error: object) -> int:
        rank = f" (rank {dist_info.rank})" if dist_info.world_size > 1 else ""
        print(f"{prog}{rank}: error: {error}", file=sys.stderr, flush=True)
        return 2

    if role is not None:
        from tidal.rl.distributed.lifeline import die_with_launcher

        die_with_launcher()  # a role of `tidal rl` ends with its launcher
    try:
        return _main(role, rest, prog, dist_info)
    except KeyboardInterrupt:
        if dist_info.is_main:
            print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return 130
    except (ValueError, FileNotFoundError, ImportError, TimeoutError) as e:
        return fail(e)
    except Exception as e:
        from tidal.rl.distributed.coupling import RoleStopped
        from tidal.store.errors import StoreError

        if isinstance(e, RoleStopped):
            return fail(e)
        if isinstance(e, StoreError):  # the store went away while this role was busy
            return fail(f"the run's store failed: {e}; this role stops")
        raise


def _main(role: str | None, argv: list[str], prog: str, dist_info) -> int:
    from tidal.rl.configs import RL_CONFIGS, get_rl_config
    from tidal.train.config_parse import apply_overrides, help_text, to_json

    about = (
        "RL post-training (GRPO family) with the store as the only coupling between roles. "
        "Any field can be overridden with --section.field VALUE; --help lists them all."
    )
    parser = argparse.ArgumentParser(prog=prog, add_help=False, description=about)
    parser.add_argument(
        "--config", default="rl_addition", help=f"one of {sorted(RL_CONFIGS)}, or MODULE:FUNCTION"
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as JSON and exit"
    )
    parser.add_argument("-h", "--help", action="store_true", help="list every config field")
    if role is None:
        parser.add_argument("--nproc", type=int, default=1, help="trainer ranks (torchrun)")
        parser.add_argument(
            "--prepare",
            action="store_true",
            help="only train (or find) the SFT warm start, then exit",
        )
    else:
        parser.add_argument(
            "--store", required=False, default="", help="tcp://HOST:PORT of the run's store"
        )
    if role == "generator":
        parser.add_argument("--index", type=int, default=0, help="this generator's number")
    args, overrides = parser.parse_known_args(argv)
    if ":" in args.config and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    cfg = get_rl_config(args.config)
    if os.environ.get("TIDAL_CACHE_DIR"):
        overrides = ["--policy.cache_dir", os.environ["TIDAL_CACHE_DIR"], *overrides]
    if args.help:
        parser.print_help()
        print()
        print(help_text(apply_overrides(cfg, overrides), args.config))
        return 0
    if role is not None and args.store:
        overrides = [*overrides, "--store.address", args.store]
    cfg = apply_overrides(cfg, overrides)
    if args.print_config:
        print(to_json(cfg))
        return 0

    from tidal.rl.distributed.launch import connect_store, launch_local
    from tidal.train.cpu_kernels import apply_cpu_kernels

    apply_cpu_kernels(cfg.job)  # before any tensor operation; the roles inherit it

    token = os.environ.get("TIDAL_STORE_TOKEN") or None  # a store's secret, as `tidal store`

    if role is None:
        if args.prepare:
            from tidal.rl.build import make_task
            from tidal.rl.warmstart import prepare_policy

            make_task(cfg)
            prepare_policy(cfg)
            return 0
        role_argv = _without_launcher_flags(argv)
        return launch_local(cfg, role_argv, nproc=args.nproc, token=token)
    address = cfg.store.address
    if not address:
        raise ValueError(f"{prog} needs the run's store: --store tcp://HOST:PORT")
    store = connect_store(address, cfg, token=token)
    try:
        if role == "trainer":
            from tidal.rl.distributed.trainer import run_trainer

            run_trainer(cfg, store, dist_info=dist_info)
        else:
            from tidal.rl.distributed.generator import run_generator

            run_generator(cfg, store, index=args.index, dist_info=dist_info)
    finally:
        store.close()
    return 0


def _without_launcher_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--nproc",):
            skip = True
        elif not a.startswith("--nproc=") and a != "--prepare":
            out.append(a)
    return out
