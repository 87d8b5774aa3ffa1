"""The `tidal` command (also `python -m tidal`).

    tidal train --config NAME|MODULE:FUNCTION [--help] [--print-config] [--nproc N]
                [--section.field VALUE ...]
    tidal generate --config NAME|--hf DIR|--checkpoint DIR --prompt TEXT [--n N] [--json] ...
    tidal serve --config NAME|--hf DIR|--checkpoint DIR [--host H] [--port P] [--api-key K] ...
    tidal convert hf-to-dcp|dcp-to-hf|dcp-to-dcp SRC DST [--flavor NAME] [--layout L] ...
    tidal fetch shakespeare|smollm2-135m [--cache-dir DIR]
    tidal configs | tidal models   (configs: the training and the RL ones, labeled)
    tidal rl [trainer|generator] --config NAME [--nproc N] [--store tcp://HOST:PORT] ...
    tidal store serve|volume|ls ...

Environment variables read here: TIDAL_CACHE_DIR sets the default of `data.cache_dir` for
`tidal train`, `tidal generate`, `tidal serve` and `tidal fetch`; torchrun's RANK, LOCAL_RANK
and WORLD_SIZE (through `DistInfo.from_env`) place a `tidal train` process. Below the command
line only `tidal.store.connect()` reads any: TIDAL_STORE, TIDAL_STORE_TOKEN and
TIDAL_STORE_TRANSPORT when no address or transport is passed.

A reader that goes away before the output ends (`tidal models | head`) ends any command
quietly with exit status 141 (`main`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

_LAUNCHED = "TIDAL_LAUNCHED"  # set by `tidal train --nproc` for the ranks it starts


def _train(argv: list[str]) -> int:
    try:
        return _train_command(argv)
    except KeyboardInterrupt:
        # In the training loop a first Ctrl-C stops after the current step (the trainer says
        # so); this one came during set-up, data preparation or the final sample, or it is a
        # second Ctrl-C in the loop.
        if os.environ.get("RANK", "0") == "0":  # once for a job, not once per rank
            print("tidal train: interrupted", file=sys.stderr)
    # Out of the handler the interrupted trainer is garbage: a rank leaves its process groups
    # now, as Trainer.close() does (not called: it waits for a background save), for a gloo
    # group destroyed at interpreter exit now and then aborts the process ("terminate called
    # without an active exception"). A save still running on its thread is abandoned, as before.
    if "torch.distributed" in sys.modules:  # no group when interrupted before it was imported
        from tidal.parallel.launch import destroy_process_group  # a no-op without a group

        destroy_process_group()
    return 130


def _train_command(argv: list[str]) -> int:
    from tidal.parallel.launch import DistInfo
    from tidal.train.config_parse import apply_overrides, help_text, to_json
    from tidal.train.configs import CONFIGS, get_config

    dist_info = DistInfo.from_env()
    if not dist_info.is_main:
        warnings.simplefilter("ignore")  # every rank would repeat them; rank 0 prints them
    launched = os.environ.get(_LAUNCHED) == "1"

    def fail(error: object) -> int:
        """Errors a user can cause: one line, exit status 2, no traceback. A rank started by
        torchrun also records it in torchrun's error file (TORCHELASTIC_ERROR_FILE), where
        `tidal train --nproc` reads it to print it once; under plain torchrun rank 0 prints."""
        message = f"tidal train: error: {error}"
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if dist_info.world_size > 1 and error_file:
            with open(error_file, "w") as f:
                json.dump({"message": message, "timestamp": int(time.time())}, f)
        if dist_info.is_main and not launched:
            print(message, file=sys.stderr)
        return 2

    parser = argparse.ArgumentParser(
        prog="tidal train",
        add_help=False,
        description="Train a model. Any field can be overridden with --section.field VALUE; "
        "`tidal train --config NAME --help` lists them all.",
    )
    parser.add_argument(
        "--config",
        default="debug",
        help=f"one of {sorted(CONFIGS)}, or MODULE:FUNCTION for a config function elsewhere "
        "(a dotted module or a .py file)",
    )
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
    if args.nproc < 1:
        return fail(f"--nproc must be at least 1, got {args.nproc}")
    if args.nproc > 1 and dist_info.world_size > 1:
        return fail("--nproc starts torchrun itself; do not pass it to a process torchrun runs")
    if ":" in args.config and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # `--config my_configs:fn` finds ./my_configs.py
    try:
        with warnings.catch_warnings():
            if args.nproc > 1:
                warnings.simplefilter("ignore")  # rank 0 prints them, once
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
        return fail(e)
    if args.print_config:
        print(to_json(cfg))
        return 0
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
            return fail(e)
        return 0
    from tidal.train.cpu_kernels import apply_cpu_kernels

    apply_cpu_kernels(cfg.job)  # before any tensor operation; torchrun's ranks inherit it
    if args.nproc > 1:
        from tidal.train.trainer import check_job, model_args_for, resolve_device

        try:  # the checks every rank would fail, made once before any rank starts
            check_job(
                cfg,
                model_args_for(cfg),
                world_size=args.nproc,
                device=resolve_device(cfg.job.device),
            )
        except (ValueError, FileNotFoundError, ImportError) as e:
            return fail(e)
        return launch_train(args.nproc, argv)

    from tidal.train.trainer import Trainer

    try:
        trainer = Trainer(cfg, dist_info=dist_info)
    except (ValueError, FileNotFoundError, ImportError) as e:
        return fail(e)
    out = Path(cfg.job.output_dir)
    if dist_info.is_main:
        t, m = cfg.training, cfg.metrics
        tokens = t.batch_size * t.seq_len * t.grad_accum_steps * trainer.dims.dp
        print(
            f"training: {t.steps} steps of {tokens:,} tokens, a line every {m.log_every} steps, "
            f"metrics to {out / 'metrics.jsonl'}",
            flush=True,
        )
        if m.log_every > 1:
            _report_first_step(trainer)
    try:
        last = trainer.train()
        end_of_run_sample(trainer, last)
    except Exception:
        trainer.close()
        raise
    trainer.close()  # not after a KeyboardInterrupt: it would wait for a save to finish
    if dist_info.is_main:
        wrote = [
            str(out / name) for name in ("metrics.jsonl", "sample.txt") if (out / name).exists()
        ]
        print(f"wrote {' and '.join(wrote)}" if wrote else f"nothing written to {out}")
    return 130 if last.get("interrupted") else 0


def end_of_run_sample(trainer, last: dict) -> str | None:
    """`tidal train`'s end-of-run sample, after `trainer.train()` returned `last`:
    `sample.prompt` continued by the generation engine (tidal.generate), logged ("sample:")
    and written to `<output_dir>/sample.txt`. Every rank runs it (FSDP's forward is
    collective) and samples the same tokens (same seed, same gathered weights). Skipped
    when `sample.max_new_tokens` is 0, when nothing was trained, after an interrupted loop,
    and (with a line saying so) under TP, PP or CP. Returns the text, or None when skipped.

    Raises:
        KeyboardInterrupt: a Ctrl-C came after the loop's last check, as a Ctrl-C in the
            sample itself would (every rank gets it).
    """
    cfg, s = trainer.cfg, trainer.cfg.sample
    if not s.max_new_tokens or not last or last.get("interrupted"):
        return None
    if trainer.dims.tp > 1 or trainer.dims.pp > 1 or trainer.dims.cp > 1:
        trainer.log("sample: skipped (end-of-run sampling runs without TP, PP or CP)")
        return None
    if trainer.interrupt_after_loop:
        raise KeyboardInterrupt
    # Said as it starts: on a CPU a long sample runs a while after the last step line.
    trainer.log(f"sampling: up to {s.max_new_tokens} tokens after {s.prompt!r}")
    tok, model = trainer.data.tokenizer, trainer.model
    prompt = [tok.bos_id] + tok.encode(s.prompt)
    new = min(s.max_new_tokens, model.args.max_seq_len - 1)
    prompt = prompt[-(model.args.max_seq_len - new) :]  # keep room for the new tokens
    model.eval()
    with trainer.autocast():
        text = s.prompt + sample_text(
            model,
            tok,
            prompt,
            max_new_tokens=new,
            temperature=s.temperature,
            top_k=s.top_k,
            seed=cfg.training.seed,
        )
    model.train()
    trainer.log("sample:\n" + text)
    if trainer.dist.is_main:
        (Path(cfg.job.output_dir) / "sample.txt").write_text(text + "\n")
    return text


def sample_text(
    model,
    tokenizer,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
) -> str:
    """One continuation of `prompt_ids` by the Generator (eager, batch of one, stopping at the
    tokenizer's EOS), as text (`end_of_run_sample`). Run it under the model's autocast, in
    eval mode.

    Example::

        text = sample_text(model, tok, [tok.bos_id] + tok.encode("ROMEO:"), max_new_tokens=40,
                           temperature=0.8, top_k=50, seed=0)
    """
    from tidal.generate import Generator, GeneratorConfig, SamplingParams

    config = GeneratorConfig(
        max_batch=1, max_seq_len=len(prompt_ids) + max_new_tokens, compile=False, cuda_graphs=False
    )
    params = SamplingParams(
        temperature=temperature, top_k=top_k, max_new_tokens=max_new_tokens, seed=seed
    )
    gen = Generator(model, tokenizer=tokenizer, config=config)
    return gen.generate([prompt_ids], params)[0][0].text or ""


def _report_first_step(trainer) -> None:
    """Print how long the first optimizer step took: the first log line comes only after
    `metrics.log_every` steps, which can be a minute or more on a CPU."""
    step = trainer.train_step

    def first_step(batches, n_tokens, loss=None):
        start = time.perf_counter()
        result = step(batches, n_tokens, loss)
        float(result.loss)  # wait for the device, once
        seconds = time.perf_counter() - start
        trainer.train_step = step  # back to the plain method for every later step
        eta = seconds * (trainer.cfg.training.steps - trainer.step)
        print(
            f"step {trainer.step} took {seconds:.2f}s (the rest: about {eta:.0f}s at that pace)",
            flush=True,
        )
        return result

    trainer.train_step = first_step


def launch_train(nproc: int, argv: list[str]) -> int:
    """Run `tidal train` on `nproc` local ranks with torchrun's launcher, in this process
    (what `python -m torch.distributed.run --standalone` does), so that Ctrl-C ends with the
    ranks' one-line messages rather than torchrun's traceback. `argv` is the command line
    after `tidal train` (its `--nproc` is dropped); returns the exit status.

    `tidal train --nproc N` calls it once every check that needs no rank has passed (tests
    replace it to check that a bad command line starts no rank).

    The ranks record a user error in torchrun's error files instead of printing it; this
    prints the first one, once, and returns 2. torchrun's own report (a traceback naming every
    failed rank) is left out; a rank that crashed has printed its traceback itself.
    """
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
    # torchrun sets OMP_NUM_THREADS=1 for several local ranks and warns that it did; set it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[_LAUNCHED] = "1"  # the ranks leave printing errors to this process
    # After Ctrl-C torchrun gives the ranks this long to finish the step and save before it
    # kills them (30 s by default; recent torch reads this variable).
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "300")
    for name in list(logging.Logger.manager.loggerDict):  # each sets its own level
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(launch))
    except SignalException:  # Ctrl-C reached torchrun too; the ranks have said what they did
        return 130
    except ChildFailedError as e:
        failures = sorted(e.failures.values(), key=lambda f: f.timestamp)
        for failure in failures:
            if isinstance(failure.message, str) and failure.message.startswith("tidal train:"):
                print(failure.message, file=sys.stderr)
                return 2
        codes = sorted({f.exitcode for f in failures})
        if len(codes) == 1 and codes[0] in (2, 130):  # bad input or Ctrl-C, already printed
            return codes[0]
        print(
            f"tidal train: {len(failures)} rank(s) failed with exit code(s) "
            f"{', '.join(map(str, codes))}; their errors are above",
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


def _convert(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tidal convert",
        description="Convert a model between a Hugging Face folder and a DCP checkpoint in "
        "tidal's or torchtitan's layout. Nothing is read before the source is checked, and DST "
        "appears only once complete.",
    )
    sub = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    dtypes = ["float32", "bfloat16", "float16"]
    to_dcp = sub.add_parser(
        "hf-to-dcp", help="a Hugging Face folder -> a model-only DCP checkpoint folder"
    )
    to_hf = sub.add_parser(
        "dcp-to-hf",
        help="the model of a DCP checkpoint (a step-N folder, or a folder of them: the newest) "
        "-> a Hugging Face folder",
    )
    to_dcp2 = sub.add_parser(
        "dcp-to-dcp",
        help="the model of a DCP checkpoint -> a model-only DCP checkpoint in another layout "
        "(torchtitan's -> tidal's, or tidal's -> torchtitan's)",
    )
    layouts = ["tidal", "torchtitan"]
    for p in (to_dcp, to_hf, to_dcp2):
        p.add_argument("src", help="source folder")
        p.add_argument("dst", help="destination folder (must not exist)")
        p.add_argument("--dtype", choices=dtypes, help="cast every tensor (default: keep)")
    to_dcp.add_argument(
        "--flavor", help="check that the model is this tidal flavor (default: the first match)"
    )
    to_dcp.add_argument(
        "--layout",
        choices=layouts,
        default="tidal",
        help="the layout to write: torchtitan's model loads a torchtitan one (default: tidal)",
    )
    for p in (to_hf, to_dcp2):
        p.add_argument(
            "--flavor", help="the model, for a checkpoint without tidal.json (else checked)"
        )
        p.add_argument(
            "--config",
            help="a named config (or MODULE:FUNCTION) whose model it is, with any "
            "--section.field overrides (e.g. --model.vocab_size); as --flavor",
        )
        p.add_argument(
            "--layout",
            choices=layouts,
            help="the layout of SRC, for a checkpoint without tidal.json, e.g. torchtitan's "
            "(else checked against it)",
        )
    to_dcp2.add_argument(
        "--to-layout", choices=layouts, default="tidal", help="the layout to write (tidal)"
    )
    to_hf.add_argument(
        "--tokenizer",
        help="a tokenizer.json (or its folder) to copy beside the weights, with the "
        "tokenizer_config.json and chat template next to it",
    )
    to_hf.add_argument(
        "--max-shard-size",
        type=int,
        default=None,
        metavar="BYTES",
        help="bytes per safetensors file (default 5e9)",
    )
    args, overrides = parser.parse_known_args(argv)
    if overrides and not getattr(args, "config", None):
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    try:
        import torch

        from tidal.models import get_flavor
        from tidal.train.checkpoint.hf import dcp_to_dcp, dcp_to_hf, hf_to_dcp

        dtype = getattr(torch, args.dtype) if args.dtype else None
        if args.direction == "hf-to-dcp":
            hf_to_dcp(args.src, args.dst, flavor=args.flavor, dtype=dtype, layout_name=args.layout)
            return 0
        if args.flavor and args.config:
            raise ValueError("give --flavor or --config, not both")
        margs = None
        if args.flavor:
            margs = get_flavor(args.flavor)
        elif args.config:
            from tidal.train.config_parse import apply_overrides
            from tidal.train.configs import get_config
            from tidal.train.trainer import model_args_for

            margs = model_args_for(apply_overrides(get_config(args.config), overrides))
        if args.direction == "dcp-to-dcp":
            dcp_to_dcp(
                args.src,
                args.dst,
                args=margs,
                layout_name=args.layout,
                to_layout=args.to_layout,
                dtype=dtype,
            )
            return 0
        dcp_to_hf(
            args.src,
            args.dst,
            args=margs,
            dtype=dtype,
            tokenizer=args.tokenizer,
            max_shard_size=args.max_shard_size,
            layout_name=args.layout,
        )
        return 0
    except KeyboardInterrupt:
        print("tidal convert: interrupted (nothing written)", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, FileExistsError, ImportError, TypeError) as e:
        print(f"tidal convert: error: {e}", file=sys.stderr)
        return 2


def _configs(argv: list[str]) -> int:
    """The named configs, in two labeled lists: `tidal train`'s and `tidal rl`'s."""
    from tidal.rl.configs import RL_CONFIGS
    from tidal.train.configs import CONFIGS

    groups: list[tuple[str, dict[str, Callable[[], object]]]] = [
        ("training configs (tidal train --config NAME):", dict(CONFIGS)),
        ("RL configs (tidal rl --config NAME):", dict(RL_CONFIGS)),
    ]
    width = max(map(len, [*CONFIGS, *RL_CONFIGS]), default=0)
    for i, (title, configs) in enumerate(groups):
        print(("\n" if i else "") + title)
        for name, fn in sorted(configs.items()):
            print(f"  {name:{width}s}  {first_sentence(fn.__doc__ or '')}")
    return 0


def first_sentence(doc: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]


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
    from tidal.generate.cli import main as generate_main

    if os.environ.get("TIDAL_CACHE_DIR"):
        argv = ["--data.cache_dir", os.environ["TIDAL_CACHE_DIR"], *argv]
    return generate_main(argv)


def _serve(argv: list[str]) -> int:
    from tidal.serve.cli import main as serve_main

    if os.environ.get("TIDAL_CACHE_DIR"):
        argv = ["--data.cache_dir", os.environ["TIDAL_CACHE_DIR"], *argv]
    return serve_main(argv)


def _rl(argv: list[str]) -> int:
    from tidal.rl.distributed.cli import main as rl_main

    return rl_main(argv)


def _store(argv: list[str]) -> int:
    from tidal.store.cli import main as store_main

    return store_main(argv)


COMMANDS = {
    "train": (_train, "train a model from a named config"),
    "generate": (_generate, "sample completions (seed init, a Hugging Face folder, a checkpoint)"),
    "serve": (_serve, "an OpenAI-compatible server (/v1/chat/completions, /v1/completions)"),
    "convert": (_convert, "convert a model: hf-to-dcp, dcp-to-hf or dcp-to-dcp"),
    "fetch": (_fetch, "download a built-in corpus or model into the cache"),
    "configs": (_configs, "list the named configs (training and RL)"),
    "models": (_models, "list the model flavors and their parameter counts"),
    "rl": (_rl, "RL post-training: trainer and generators coupled by the store"),
    "store": (_store, "run or inspect a tidal.store service (serve, volume, ls)"),
}


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status. A reader that goes away before the output
    ends (`tidal models | head`) ends the command quietly with status 141 (128 + SIGPIPE, what
    a shell reports for a tool stopped by the closed pipe), not with a traceback."""
    try:
        code = _dispatch(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # the last buffered lines meet a closed pipe here, inside the try
    except BrokenPipeError:
        # Point stdout at /dev/null so that the interpreter's final flush of what is still
        # buffered does not fail again ("Exception ignored ... BrokenPipeError").
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        code = 141
    _forget_caught_interrupts()
    return code


def _forget_caught_interrupts() -> None:
    """Every Ctrl-C has been handled once a command returns; make CPython agree.

    CPython marks a KeyboardInterrupt "unhandled" when it leaves the `exec` or `eval` of a
    source string, even if a caller catches it later, and at exit a `python -m` run with the
    mark kills itself with SIGINT instead of exiting with the status it returned (130 after a
    Ctrl-C). A Ctrl-C often lands in such an `exec`: `dataclasses` builds each class's methods
    from source text, so any lazy import of a module that defines dataclasses is one. Every
    string `exec` clears the mark as it starts, so a trivial one clears it here.
    """
    exec("pass", {})


def _dispatch(argv: list[str]) -> int:
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
