"""`tidal generate`: sample from a model with the Generator.

    tidal generate [--config NAME | --hf DIR | --checkpoint DIR]
                   [--prompt TEXT ...] [--prompts FILE] [--chat]
                   [--n N] [--temperature T] [--top-p P] [--top-k K] [--min-p P]
                   [--max-new-tokens N] [--seed S] [--stop STR ...] [--json]
                   [--batch-invariant] [--max-batch N] [--device D] [--dtype D]
                   [--section.field VALUE ...]

The model:

- `--config NAME` (the default, `debug`): the named config's model, seed init
  (`training.seed`), with the tokenizer of the config's data (built without encoding the
  corpus; see tidal.train.data.build_tokenizer). Any config field can be overridden as for
  `tidal train` (e.g. `--data.path`, `--model.flavor`).
- `--hf DIR`: a Hugging Face folder (tidal.models.load_hf), with the `tokenizer.json` in it
  unless `--data.tokenizer` names another. Prompts are encoded as transformers encodes them
  (the tokenizer's own template, e.g. Llama 3's BOS; special tokens written in the text are
  read as such), and generation stops at config.json's `eos_token_id`, as transformers'
  `generate` does.
- `--checkpoint DIR`: a DCP checkpoint of a tidal run (a `step-N` folder, or the run's
  checkpoint folder for its newest), model-only or a full training save; the architecture
  comes from its tidal.json, the tokenizer from the config's data as for `--config` (pass the
  run's `--config` and `--data.*`). A torchtitan checkpoint (no tidal.json) needs `--layout
  torchtitan` and the config's `--model.*` for its architecture.

With `--config` and `--checkpoint` a plain prompt is encoded as BOS + text, as the trainer
packs documents, and generation stops at the tokenizer's EOS. `--chat` renders each prompt (or
each `messages` list of a prompts file) with the tokenizer's chat template, read from the
`tokenizer_config.json` (or `chat_template.jinja`) next to the tokenizer.json, with its
`bos_token`/`eos_token` when it names them. Request i uses seed S + i.

`--prompts FILE` is JSON lines: {"prompt": "..."} or {"messages": [{"role": ..., "content":
...}, ...]} per line. `--json` prints one object per sample: prompt_index, sample_index,
prompt_ids, completion_ids, text, finish_reason, logprobs, sampling_logprobs,
weight_version.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `build_model` reads (`tidal generate` and `tidal serve` share them)."""
    parser.add_argument(
        "--config", default="debug", help="named config: its model (seed init), its tokenizer"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face folder (weights, tokenizer)")
    source.add_argument(
        "--checkpoint", metavar="DIR", help="a tidal run's DCP checkpoint (step-N, or its folder)"
    )
    parser.add_argument(
        "--layout",
        choices=("tidal", "torchtitan"),
        help="the weights' layout of a --checkpoint without tidal.json (another tool's DCP)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16"],
        help="weights' dtype (auto: bf16 on CUDA, fp32 on CPU)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts", help='JSON lines: {"prompt": ...} or {"messages": [...]}')
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="request i uses seed S + i")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="one JSON object per sample")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="fixed reduction orders: log-probs bitwise equal to the trainer's",
    )
    parser.add_argument("--max-batch", type=int, default=32, help="samples decoded at once")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tidal generate",
        description="Generate completions with the training model's code (tidal.generate).",
    )
    add_arguments(parser)
    args, overrides = parser.parse_known_args(argv)
    try:
        return _run(args, overrides)
    except (ValueError, FileNotFoundError, KeyError, ImportError) as e:
        print(f"tidal generate: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from tidal.generate.generator import Generator, GeneratorConfig
    from tidal.generate.sampler import SamplingParams
    from tidal.train.config_parse import apply_overrides
    from tidal.train.configs import get_config
    from tidal.train.data import build_tokenizer
    from tidal.train.trainer import resolve_device

    if args.hf:  # the architecture and (unless --data.tokenizer) the tokenizer of the folder
        overrides = [*overrides, "--checkpoint.initial_load_hf", args.hf]
    cfg = apply_overrides(get_config(args.config), overrides)
    messages = _read_prompts(args)
    try:
        tokenizer = build_tokenizer(cfg.data, log=lambda line: print(line, file=sys.stderr))
    except FileNotFoundError as e:
        if not args.hf:
            raise
        raise FileNotFoundError(f"--hf {args.hf}: {e}; pass --data.tokenizer PATH") from None
    chat = _chat_template(cfg.data.tokenizer) if args.chat else None
    encode_hf = hf_encoder(cfg.data.tokenizer) if args.hf else None
    prompts = [_encode(tokenizer, m, chat, encode_hf) for m in messages]

    device = resolve_device(args.device if args.device != "auto" else cfg.job.device)
    dtype = args.dtype if args.dtype != "auto" else "bf16" if device.type == "cuda" else "fp32"
    model = build_model(args, cfg, device, torch.bfloat16 if dtype == "bf16" else torch.float32)
    margs = model.args
    if tokenizer.vocab_size > margs.vocab_size:
        where = args.hf or args.checkpoint or f"model.flavor {cfg.model.flavor!r}"
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model of {where} "
            f"embeds only {margs.vocab_size}"
        )
    stop_ids = hf_stop_ids(margs) if args.hf else None

    params = [
        SamplingParams(
            n=args.n,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            max_new_tokens=args.max_new_tokens,
            stop=tuple(args.stop),
            stop_token_ids=stop_ids,
            seed=args.seed + i,
        )
        for i in range(len(prompts))
    ]
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    config = GeneratorConfig(
        max_batch=max(1, min(args.max_batch, args.n * len(prompts))),
        max_seq_len=min(margs.max_seq_len, -(-longest // 16) * 16),
        batch_invariant=args.batch_invariant,
    )
    generator = Generator(model, tokenizer=tokenizer, config=config)
    groups = generator.generate(prompts, params)
    for group in groups:
        for s in group:
            if args.json:
                print(json.dumps(s.to_json()))
            else:
                head = f"--- prompt {s.prompt_index} sample {s.sample_index} "
                print(f"{head}({s.finish_reason}, {len(s.completion_ids)} tokens)")
                print(tokenizer.decode(s.prompt_ids) + (s.text or ""))
    return 0


def build_model(args: argparse.Namespace, cfg: Any, device: Any, dtype: Any) -> Any:
    """The model of --hf, --checkpoint or the config (seed init), on `device` in `dtype`
    (`tidal generate` and `tidal serve` take the same flags)."""
    import dataclasses

    import torch

    from tidal.models.transformer import Transformer, rope_tables
    from tidal.train.trainer import model_args_for

    if args.hf:
        from tidal.models.hf import load_hf

        return load_hf(args.hf, device=device, dtype=dtype)
    if args.checkpoint:
        from tidal.train.checkpoint import layout
        from tidal.train.checkpoint.hf import read_model, resolve_checkpoint
        from tidal.train.checkpoint.plan import args_from_info

        # The architecture the checkpoint records; the config's only for a DCP folder of
        # another tool (no tidal.json).
        path = resolve_checkpoint(Path(args.checkpoint).expanduser())
        recorded = args_from_info(layout.verify(path), path)
        margs, state_dict, _ = read_model(
            path,
            None if recorded is not None else model_args_for(cfg),
            layout_name=args.layout,
            log=lambda line: print(line, file=sys.stderr),
            progress=False,
        )
        margs = dataclasses.replace(margs, attention="sdpa")  # generation runs SDPA + cache
        with torch.device("meta"):
            model = Transformer(margs)
        model.to_empty(device=device)
        model.rope.copy_(rope_tables(margs, device=device))
        model.load_state_dict(state_dict)  # copies, converting dtypes
        return model.to(dtype)
    with torch.device("meta"):
        model = Transformer(model_args_for(cfg))
    model.to_empty(device=device)
    model.init_weights(seed=cfg.training.seed)
    return model.to(dtype)


def hf_encoder(tokenizer_path: str) -> Any:
    """Plain prompts as transformers' tokenizer(text) encodes them: the tokenizer.json's own
    post-processor (BOS where the model wants one), special tokens in the text read as such."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(Path(tokenizer_path).expanduser()))
    return lambda text: tok.encode(text, add_special_tokens=True).ids


def hf_stop_ids(margs: Any) -> tuple[int, ...] | None:
    """config.json's eos_token_id (an id or a list), where transformers' generate stops; None
    (the tokenizer's EOS) when the config names none."""
    eos = margs.extra.get("hf", {}).get("eos_token_id")
    if eos is None:
        return None
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _read_prompts(args: argparse.Namespace) -> list[Any]:
    """Prompt strings, or message lists from a prompts file."""
    items: list[Any] = list(args.prompt)
    if args.prompts:
        path = Path(args.prompts)
        if not path.is_file():
            raise FileNotFoundError(f"--prompts file not found: {path}")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from e
            if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                items.append(record["prompt"])
            elif isinstance(record, dict) and isinstance(record.get("messages"), list):
                items.append(record["messages"])
            else:
                raise ValueError(
                    f'{path}:{n}: expected {{"prompt": "..."}} or {{"messages": [...]}}'
                )
    if not items:
        raise ValueError("no prompts: give --prompt TEXT (repeatable) or --prompts FILE")
    return items


def _chat_template(tokenizer_path: str) -> tuple[str, str | None, str | None]:
    """(template, bos_token, eos_token) of the tokenizer_config.json (or chat_template.jinja)
    beside a tokenizer.json; the token strings are None where the config names none."""
    if tokenizer_path == "bpe":
        raise ValueError(
            "--chat needs a tokenizer with a chat template; the config's data.tokenizer is a "
            "BPE trained on the fly, which has none (pass --data.tokenizer "
            "path/to/tokenizer.json with a tokenizer_config.json beside it)"
        )
    folder = Path(tokenizer_path).expanduser().parent
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str) and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if not isinstance(template, str):
        raise FileNotFoundError(
            f"--chat: no chat template beside {tokenizer_path} (looked for chat_template in "
            f"{path} and for {folder / 'chat_template.jinja'})"
        )

    def token(name: str) -> str | None:
        value = config.get(name)
        if isinstance(value, dict):  # {"content": "<s>", ...}, as older configs write it
            value = value.get("content")
        return value if isinstance(value, str) else None

    return template, token("bos_token"), token("eos_token")


def render_chat(template: str, messages: list[dict], *, bos: str, eos: str) -> str:
    """Render a Hugging Face chat template (Jinja) for `messages`, ending with the generation
    prompt, in a sandboxed environment."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
    )


def _encode(
    tokenizer: Any,
    prompt: Any,
    chat: tuple[str, str | None, str | None] | None,
    hf_encoder: Any = None,
) -> list[int]:
    if chat is None:
        if not isinstance(prompt, str):
            raise ValueError("a prompts-file 'messages' record needs --chat")
        if hf_encoder is not None:
            return hf_encoder(prompt)
        return [tokenizer.bos_id, *tokenizer.encode(prompt)]
    template, bos, eos = chat
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    bos = bos or tokenizer.decode([tokenizer.bos_id], skip_special_tokens=False)
    eos = eos or tokenizer.decode([tokenizer.eos_id], skip_special_tokens=False)
    return tokenizer.encode(render_chat(template, messages, bos=bos, eos=eos), special_tokens=True)
