"""`tidal generate`: sample from a model with the Generator.

    tidal generate --config NAME [--prompt TEXT ...] [--prompts FILE] [--chat]
                   [--n N] [--temperature T] [--top-p P] [--top-k K] [--min-p P]
                   [--max-new-tokens N] [--seed S] [--stop STR ...] [--json]
                   [--batch-invariant] [--max-batch N] [--device D] [--dtype D]
                   [--section.field VALUE ...]

The model is the named config's (seed init, `training.seed`), with the tokenizer of the
config's data (built without encoding the corpus; see tidal.train.data.build_tokenizer). Any
config field can be overridden as for `tidal train` (e.g. `--data.path`, `--model.flavor`).
A plain prompt is encoded as BOS + text, as the trainer packs documents; `--chat` renders
each prompt (or each `messages` list of a prompts file) with the tokenizer's chat template,
read from the `tokenizer_config.json` next to `data.tokenizer`. Request i uses seed S + i.

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="debug", help="named config whose model is used")
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
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                        help="weights' dtype (auto: bf16 on CUDA, fp32 on CPU)")  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tidal generate",
        description="Generate completions with the training model's code (tidal.rl.Generator).",
    )
    add_arguments(parser)
    args, overrides = parser.parse_known_args(argv)
    try:
        return _run(args, overrides)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"tidal generate: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    import torch

    from tidal.models.transformer import Transformer
    from tidal.rl.generate import Generator, GeneratorConfig
    from tidal.rl.sampling import SamplingParams
    from tidal.train.config_parse import apply_overrides
    from tidal.train.configs import get_config
    from tidal.train.data import build_tokenizer
    from tidal.train.trainer import model_args_for, resolve_device

    cfg = apply_overrides(get_config(args.config), overrides)
    messages = _read_prompts(args)
    tokenizer = build_tokenizer(cfg.data, log=lambda line: print(line, file=sys.stderr))
    template = _chat_template(cfg.data.tokenizer) if args.chat else None
    prompts = [_encode(tokenizer, m, template) for m in messages]

    margs = model_args_for(cfg)
    if tokenizer.vocab_size > margs.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.flavor "
            f"{cfg.model.flavor!r} embeds only {margs.vocab_size}"
        )
    device = resolve_device(args.device if args.device != "auto" else cfg.job.device)
    dtype = args.dtype if args.dtype != "auto" else "bf16" if device.type == "cuda" else "fp32"
    with torch.device("meta"):
        model = Transformer(margs)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.training.seed)
    if dtype == "bf16":
        model.to(torch.bfloat16)

    params = [
        SamplingParams(
            n=args.n,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            max_new_tokens=args.max_new_tokens,
            stop=tuple(args.stop),
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


def _chat_template(tokenizer_path: str) -> str:
    """The `chat_template` of the tokenizer_config.json beside a tokenizer.json."""
    if tokenizer_path == "bpe":
        raise ValueError(
            "--chat needs a tokenizer with a chat template; the config's data.tokenizer is a "
            "BPE trained on the fly, which has none (pass --data.tokenizer "
            "path/to/tokenizer.json with a tokenizer_config.json beside it)"
        )
    path = Path(tokenizer_path).expanduser().parent / "tokenizer_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--chat: no {path} (the chat template lives there)")
    template = json.loads(path.read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise ValueError(f"--chat: {path} has no chat_template")
    return template


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


def _encode(tokenizer: Any, prompt: Any, template: str | None) -> list[int]:
    if template is None:
        if not isinstance(prompt, str):
            raise ValueError("a prompts-file 'messages' record needs --chat")
        return [tokenizer.bos_id, *tokenizer.encode(prompt)]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    bos = tokenizer.decode([tokenizer.bos_id], skip_special_tokens=False)
    eos = tokenizer.decode([tokenizer.eos_id], skip_special_tokens=False)
    return tokenizer.encode(render_chat(template, messages, bos=bos, eos=eos), special_tokens=True)
