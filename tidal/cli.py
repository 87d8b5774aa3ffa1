"""The `tidal` command (also `python -m tidal`).

    tidal train --config NAME [--help] [--print-config] [--section.field VALUE ...]
    tidal generate --config NAME --prompt TEXT [--n N] [--temperature T] [--json] ...
    tidal fetch shakespeare|smollm2-135m [--cache-dir DIR]
    tidal configs | tidal models
    tidal store serve|volume|ls ...

Environment variables read here: TIDAL_CACHE_DIR sets the default of `data.cache_dir` for
`tidal train`, `tidal generate` and `tidal fetch`; torchrun's RANK, LOCAL_RANK and WORLD_SIZE
(through `DistInfo.from_env`) place a `tidal train` process. Below the command line only
`tidal.store.connect()` reads any: TIDAL_STORE, TIDAL_STORE_TOKEN and TIDAL_STORE_TRANSPORT
when no address or transport is passed.
"""

from __future__ import annotations

import argparse
import os
import sys


def _train(argv: list[str]) -> int:
    try:
        return _train_command(argv)
    except KeyboardInterrupt:
        # In the training loop a first Ctrl-C stops after the current step (the trainer says
        # so); this one came during set-up, data preparation or the final sample, or it is a
        # second Ctrl-C in the loop.
        print("tidal train: interrupted", file=sys.stderr)
        return 130


def _train_command(argv: list[str]) -> int:
    from tidal.train.config_parse import apply_overrides, help_text, to_json
    from tidal.train.configs import CONFIGS, get_config

    parser = argparse.ArgumentParser(
        prog="tidal train",
        add_help=False,
        description="Train a model. Any field can be overridden with --section.field VALUE; "
        "`tidal train --config NAME --help` lists them all.",
    )
    parser.add_argument("--config", default="debug", help=f"one of {sorted(CONFIGS)}")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as JSON and exit"
    )
    parser.add_argument("-h", "--help", action="store_true", help="list every config field")
    parser.add_argument(
        "--nproc", type=int, default=1, help="spawn this many local ranks through torchrun"
    )
    parser.add_argument(
        "--dry-run",
        type=int,
        default=0,
        metavar="WORLD_SIZE",
        help="validate the parallel layout for WORLD_SIZE ranks in this one "
        "process (fake process group, meta-device model) and exit",
    )
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = get_config(args.config)
        if os.environ.get("TIDAL_CACHE_DIR"):
            overrides = ["--data.cache_dir", os.environ["TIDAL_CACHE_DIR"], *overrides]
        if args.help:
            parser.print_help()
            print()
            print(help_text(apply_overrides(cfg, overrides), args.config))
            return 0
        cfg = apply_overrides(cfg, overrides)
    except ValueError as e:
        print(f"tidal train: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_json(cfg))
        return 0
    if args.nproc > 1:
        return _run_local_ranks(args.nproc, argv)
    if args.dry_run:
        from tidal.parallel.dry_run import dry_run
        from tidal.train.trainer import model_args_for

        try:
            dry_run(
                model_args_for(cfg),
                cfg.parallelism,
                cfg.activation_checkpoint,
                world_size=args.dry_run,
                seq_len=cfg.training.seq_len,
                batch_size=cfg.training.batch_size,
                bf16=cfg.training.mixed_precision != "fp32",  # auto: bf16, as on a GPU
                model_name=f"model.flavor {cfg.model.flavor!r}",
            )
        except ValueError as e:
            print(f"tidal train: error: {e}", file=sys.stderr)
            return 2
        return 0

    from tidal.parallel.launch import DistInfo
    from tidal.train.trainer import Trainer

    try:
        trainer = Trainer(cfg, dist_info=DistInfo.from_env())
    except (ValueError, FileNotFoundError) as e:
        print(f"tidal train: error: {e}", file=sys.stderr)
        return 2
    try:
        last = trainer.train()
    except Exception:
        trainer.close()
        raise
    trainer.close()  # not after a KeyboardInterrupt: it would wait for a save to finish
    return 130 if last.get("interrupted") else 0


def _run_local_ranks(nproc: int, argv: list[str]) -> int:
    """Run `tidal train` on `nproc` local ranks through torchrun, inside this process, so
    that Ctrl-C ends with the ranks' one-line messages rather than torchrun's traceback."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    launch = ["--standalone", f"--nproc_per_node={nproc}", "-m", "tidal", "train", *rest]
    # After Ctrl-C torchrun gives the ranks this long to finish the step and save before it
    # kills them (30 s by default; recent torch reads this variable).
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")
    for name in list(logging.Logger.manager.loggerDict):  # each sets its own level
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        run(get_args_parser().parse_args(launch))
    except SignalException:  # Ctrl-C reached torchrun too; the ranks have said what they did
        return 130
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        if len(codes) == 1 and codes[0] in (2, 130):  # bad input or Ctrl-C, already printed
            return codes[0]
        codes_text = ", ".join(map(str, codes))
        print(
            f"tidal train: {len(e.failures)} rank(s) failed with exit code(s) {codes_text}; "
            "their errors are above",
            file=sys.stderr,
        )
        return 1
    return 0


def _fetch(argv: list[str]) -> int:
    from tidal.train.data.fetch import add_fetch_arguments, run_fetch

    parser = argparse.ArgumentParser(
        prog="tidal fetch",
        description="Download a built-in corpus or model into tidal's cache "
        "(done once at set-up; training never downloads).",
    )
    add_fetch_arguments(parser)
    if os.environ.get("TIDAL_CACHE_DIR"):
        parser.set_defaults(cache_dir=os.environ["TIDAL_CACHE_DIR"])
    return run_fetch(parser.parse_args(argv))


def _configs(argv: list[str]) -> int:
    from tidal.train.configs import CONFIGS

    for name, fn in sorted(CONFIGS.items()):
        doc = (fn.__doc__ or "").strip().splitlines()
        print(f"{name:14s} {doc[0] if doc else ''}")
    return 0


def _models(argv: list[str]) -> int:
    import torch

    from tidal.models import FLAVORS, Transformer

    print(
        f"{'flavor':14s} {'params':>14s} {'dim':>5s} {'layers':>6s} {'heads':>5s} "
        f"{'kv':>3s} {'vocab':>7s}"
    )
    for name, a in FLAVORS.items():
        with torch.device("meta"):
            n = sum(p.numel() for p in Transformer(a).parameters())
        print(
            f"{name:14s} {n:>14,d} {a.dim:>5d} {a.n_layers:>6d} {a.n_heads:>5d} "
            f"{a.n_kv_heads:>3d} {a.vocab_size:>7d}"
        )
    return 0


def _generate(argv: list[str]) -> int:
    from tidal.rl.cli import main as generate_main

    if os.environ.get("TIDAL_CACHE_DIR"):
        argv = ["--data.cache_dir", os.environ["TIDAL_CACHE_DIR"], *argv]
    return generate_main(argv)


def _store(argv: list[str]) -> int:
    from tidal.store.cli import main as store_main

    return store_main(argv)


COMMANDS = {
    "train": (_train, "train a model from a named config"),
    "generate": (_generate, "sample completions from a named config's model"),
    "fetch": (_fetch, "download a built-in corpus or model into the cache"),
    "configs": (_configs, "list the named training configs"),
    "models": (_models, "list the model flavors and their parameter counts"),
    "store": (_store, "run or inspect a tidal.store service (serve, volume, ls)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = COMMANDS
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: tidal COMMAND [ARGS]\n\ncommands:")
        for name, (_, doc) in commands.items():
            print(f"  {name:8s} {doc}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\ntidal: error: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    return commands[argv[0]][0](argv[1:])
