"""`tidal serve`: an OpenAI-compatible server on the Generator.

    tidal serve [--config NAME | --hf DIR | --checkpoint DIR] [--host H] [--port P]
                [--api-key KEY] [--model-name NAME] [--max-batch N] [--sessions N]
                [--max-seq-len N]
                [--batch-invariant] [--store ADDRESS [--store-key KEY]] [--device D]
                [--dtype D] [--section.field VALUE ...]

The model, its tokenizer and how plain prompts are encoded come as for `tidal generate`
(tidal/generate/cli.py: its loading code is reused). Chat requests are rendered with the
tokenizer's chat template (`--data.chat_template` to choose another; tidal's built-in ChatML
when there is none). Listens on 127.0.0.1 unless `--host` says otherwise. `--store` serves the
policy an RL run is training: the newest version of `--store-key` in that store, loaded as
the trainer publishes it (tidal/serve/follow.py), each token stamped with its version. Needs
the `serve` extra (`pip install 'tidal[serve]'`: FastAPI and uvicorn).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

MISSING_EXTRA = (
    "tidal serve: needs FastAPI and uvicorn, which are not installed: pip install 'tidal[serve]'"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tidal.generate.cli import add_model_arguments

    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every request")
    parser.add_argument(
        "--model-name", help="the model id clients pass (default: the config, folder or run)"
    )
    parser.add_argument("--max-batch", type=int, default=64, help="samples decoded at once")
    parser.add_argument(
        "--sessions",
        type=int,
        default=0,
        help="chat sessions (X-Session-ID) continued from their exact token ids (0: none)",
    )
    parser.add_argument(
        "--max-seq-len", type=int, help="positions per sample, prompt included (default: model's)"
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="fixed reduction orders: log-probs bitwise equal to the trainer's",
    )
    parser.add_argument(
        "--store",
        metavar="ADDRESS",
        help="follow an RL run: load the newest version of --store-key from this tidal store "
        "(tcp://host:port) as it is published",
    )
    parser.add_argument("--store-key", default="policy", help="the state dict's key in the store")
    parser.add_argument(
        "--follow-every", type=float, default=1.0, help="seconds between checks for a version"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tidal serve",
        description="An OpenAI-compatible server (/v1/chat/completions, /v1/completions).",
    )
    add_arguments(parser)
    args, overrides = parser.parse_known_args(argv)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        print(MISSING_EXTRA, file=sys.stderr)
        return 2
    from tidal.store.errors import StoreError

    try:
        served = build_served(args, overrides)
    except (ValueError, OSError, KeyError, StoreError) as e:  # OSError: files, TimeoutError
        print(f"tidal serve: error: {e}", file=sys.stderr)
        return 2
    from tidal.serve.app import create_app

    app = create_app(served, api_key=args.api_key)
    print(
        f"tidal serve: {served.name!r} (max_batch {served.engine.generator.config.max_batch}, "
        f"context {served.capacity}) on http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def build_served(args: argparse.Namespace, overrides: list[str]) -> Any:
    """The Served model of the arguments (the model, tokenizer and encoders as `tidal
    generate` builds them), its Engine not yet started."""
    import torch

    from tidal.generate import Generator, GeneratorConfig
    from tidal.generate.cli import build_model, hf_encoder, hf_stop_ids
    from tidal.serve.api import Served
    from tidal.serve.chat import ChatFormat
    from tidal.serve.engine import Engine
    from tidal.train.config_parse import apply_overrides
    from tidal.train.configs import get_config
    from tidal.train.data import build_tokenizer
    from tidal.train.data.chat import build_encoder
    from tidal.train.trainer import resolve_device

    if args.hf:
        overrides = [*overrides, "--checkpoint.initial_load_hf", args.hf]
    cfg = apply_overrides(get_config(args.config), overrides)
    log = lambda line: print(line, file=sys.stderr)
    try:
        tokenizer = build_tokenizer(cfg.data, log=log)
    except FileNotFoundError as e:
        if not args.hf:
            raise
        raise FileNotFoundError(f"--hf {args.hf}: {e}; pass --data.tokenizer PATH") from None
    device = resolve_device(args.device if args.device != "auto" else cfg.job.device)
    dtype = args.dtype if args.dtype != "auto" else "bf16" if device.type == "cuda" else "fp32"
    model = build_model(args, cfg, device, torch.bfloat16 if dtype == "bf16" else torch.float32)
    if tokenizer.vocab_size > model.args.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model embeds only "
            f"{model.args.vocab_size}"
        )
    stop_ids = hf_stop_ids(model.args) if args.hf else None
    config = GeneratorConfig(
        max_batch=args.max_batch,
        max_seq_len=args.max_seq_len,
        batch_invariant=args.batch_invariant,
    )
    generator = Generator(model, tokenizer=tokenizer, config=config)
    path = None if cfg.data.tokenizer == "bpe" else cfg.data.tokenizer
    chat = ChatFormat(build_encoder(tokenizer, cfg.data.chat_template, path), stop_ids or ())
    if args.hf:
        encode = hf_encoder(cfg.data.tokenizer)
    else:
        encode = lambda text: [tokenizer.bos_id, *tokenizer.encode(text)]
    if args.store:
        import tidal.store
        from tidal.serve.follow import StoreFollower

        follower = StoreFollower(
            generator, tidal.store.connect(args.store), args.store_key, every=args.follow_every
        )
        log(f"tidal serve: {args.store_key} version {follower.load_first()} from {args.store}")
        generator.swap_hook = follower
    name = args.model_name or (
        Path(args.hf or args.checkpoint).expanduser().resolve().name
        if args.hf or args.checkpoint
        else args.config
    )
    return Served(name, Engine(generator), encode, chat, stop_ids, sessions=args.sessions)
