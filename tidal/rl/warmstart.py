"""Where the policy starts: its architecture, tokenizer, prompt template and first weights.

`resolve_policy(cfg)` reads `policy.init` (tidal/rl/config.py) and returns a `PolicySource`.
Only the trainer reads the first weights (a checkpoint or a Hugging Face folder); it publishes
them as version 0, and generators take every version from the store, so they need only the
architecture and the tokenizer.

SFT warm starts (`policy.init = "sft:NAME"`) are trained once and cached: the folder
`<cache_dir>/warmstart/<NAME>-<hash>` (the hash of the resolved SFT config) holds the run,
its metrics and its final checkpoint. `prepare_policy` trains it when it is missing (the
launcher calls it before any role starts); a role given a missing one fails with the
command that builds it. An interrupted SFT run leaves only a `.partial` folder, which the
next attempt replaces.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidal.models.flavors import FLAVORS
from tidal.models.transformer import ModelArgs
from tidal.rl.config import RLConfig
from tidal.train.data import Tokenizer, build_tokenizer
from tidal.train.data.chat import ChatEncoder, build_encoder

Log = Callable[[str], None]


@dataclass(kw_only=True)
class PolicySource:
    """The policy's starting point, resolved from `policy.init`."""

    args: ModelArgs
    """The architecture (vocabulary included)."""
    flavor: str
    """The tidal flavor the trainer builds (`model.flavor` of its config); for a Hugging Face
    folder only a name (a matching flavor, else `model.flavor`): the trainer builds the
    folder's config.json."""
    vocab_size: int | None
    """The vocabulary override of that flavor (`model.vocab_size`), None for none."""
    tokenizer: Tokenizer
    encoder: ChatEncoder
    """Renders a task's prompt as the model was trained to read it; `stop_ids` end a turn."""
    checkpoint: Path | None = None
    """A tidal checkpoint (step-N folder) the trainer loads (model only), or None."""
    hf_folder: Path | None = None
    """A Hugging Face folder the trainer loads, or None."""
    describe: str = ""
    """One line for the log: where the weights come from."""


def resolve_policy(cfg: RLConfig, *, log: Log = print) -> PolicySource:
    """The `PolicySource` of `cfg.policy`, without training anything.

    Raises:
        FileNotFoundError: the checkpoint, folder or tokenizer does not exist, or an SFT warm
            start has not been trained yet (the message says how).
        ValueError: an unknown SFT config, a Hugging Face model shape that is no flavor.
    """
    p = cfg.policy
    if p.kind == "sft":
        sft, folder = sft_run(cfg)
        ckpt = folder / "checkpoint" / f"step-{sft.training.steps}"
        if not _complete(ckpt):
            raise FileNotFoundError(
                f"the SFT warm start {p.source!r} is not trained yet ({ckpt} is missing); "
                f"`tidal rl --config ... --prepare` (or a plain `tidal rl` run) trains it once"
            )
        tok = build_tokenizer(sft.data, log=lambda _line: None)
        tok_path = None if sft.data.tokenizer == "bpe" else sft.data.tokenizer
        encoder = build_encoder(tok, p.chat_template or sft.data.chat_template, tok_path)
        from tidal.train.trainer import model_args_for

        return PolicySource(
            args=model_args_for(sft),
            flavor=sft.model.flavor,
            vocab_size=sft.model.vocab_size,
            tokenizer=tok,
            encoder=encoder,
            checkpoint=ckpt,
            describe=f"SFT warm start {p.source} ({ckpt})",
        )
    if p.kind == "hf":
        from tidal.models.hf import hf_model_args

        folder = Path(p.source).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"policy.init: no Hugging Face config.json in {folder}")
        from tidal.train.checkpoint.hf import matching_flavor

        # Any Llama / Qwen 3 shape: the trainer builds config.json's architecture
        # (checkpoint.initial_load_hf), so the folder need not be a named flavor.
        args = hf_model_args(folder)
        if not p.tokenizer and not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"policy.init: no tokenizer.json in {folder}; name one with policy.tokenizer"
            )
        tok_spec = p.tokenizer or str(folder / "tokenizer.json")
        tok = policy_tokenizer(tok_spec, cfg)
        tok_path = None if tok_spec.startswith("sft:") else tok_spec
        encoder = build_encoder(tok, p.chat_template, tok_path)
        return PolicySource(
            args=args,
            flavor=matching_flavor(args) or cfg.model.flavor,
            vocab_size=None,
            tokenizer=tok,
            encoder=encoder,
            hf_folder=folder,
            describe=f"Hugging Face folder {folder}",
        )
    tok = policy_tokenizer(p.tokenizer, cfg)
    tok_path = p.tokenizer if not p.tokenizer.startswith("sft:") else None
    encoder = build_encoder(tok, p.chat_template, tok_path)
    if p.kind == "checkpoint":
        path = _newest_step(Path(p.source).expanduser())
        from tidal.train.checkpoint.hf import matching_flavor
        from tidal.train.checkpoint.plan import args_from_info

        info = json.loads((path / "tidal.json").read_text())
        named = info.get("model", {}).get("flavor")
        saved = args_from_info(info, path)
        flavor = named
        if flavor not in FLAVORS and saved is not None:
            # A run started from a Hugging Face folder records "hf:PATH" as its flavor.
            flavor = matching_flavor(saved)
        if flavor not in FLAVORS:
            raise ValueError(
                f"policy.init: the model of {path}/tidal.json ({named!r}) is no tidal flavor "
                "(see `tidal models`); the trainer builds a checkpoint's model from its flavor"
            )
        differs = saved is not None and saved.vocab_size != FLAVORS[flavor].vocab_size
        vocab = saved.vocab_size if saved is not None and differs else None
        args = FLAVORS[flavor]
        if vocab is not None:
            args = dataclasses.replace(args, vocab_size=vocab)
        return PolicySource(
            args=args,
            flavor=flavor,
            vocab_size=vocab,
            tokenizer=tok,
            encoder=encoder,
            checkpoint=path,
            describe=f"checkpoint {path}",
        )
    from dataclasses import replace

    args = FLAVORS[cfg.model.flavor]
    if cfg.model.vocab_size is not None:
        args = replace(args, vocab_size=cfg.model.vocab_size)
    seed = f"seed init of {cfg.model.flavor} (seed {cfg.trainer.seed})"
    return PolicySource(
        args=args,
        flavor=cfg.model.flavor,
        vocab_size=cfg.model.vocab_size,
        tokenizer=tok,
        encoder=encoder,
        describe=seed,
    )


def policy_args(cfg: RLConfig, *, log: Log = print):
    """The policy's ModelArgs without training anything: an SFT warm start's from its
    config (trained or not), others' from `resolve_policy` (its lines are not logged)."""
    if cfg.policy.kind == "sft":
        from tidal.train.trainer import model_args_for

        return model_args_for(sft_run(cfg)[0])
    return resolve_policy(cfg, log=lambda *_: None).args


def sft_run(cfg: RLConfig):
    """(the SFT config, its cache folder) of `policy.init = "sft:NAME"`."""
    from tidal.train.config_parse import apply_overrides, to_dict
    from tidal.train.configs import get_config

    name = cfg.policy.source
    sft = get_config(name)
    try:
        extra = [
            t if t.startswith("--") else f"--{t}" for t in shlex.split(cfg.policy.sft_overrides)
        ]
        sft = apply_overrides(sft, ["--data.cache_dir", cfg.policy.cache_dir, *extra])
    except ValueError as e:
        raise ValueError(f"policy.sft_overrides: {e}") from e
    described: dict[str, Any] = dict(to_dict(sft))
    described["job"].pop("output_dir")
    described["job"].pop("device")
    # Tools that never change the trained weights stay out of the key, and so does a feature
    # left off (float8), so adding such config sections does not retrain every cached start.
    for section in ("profiler", "debug"):
        described.pop(section, None)
    for field in [f for f in described["metrics"] if f.startswith(("wandb", "tensorboard"))]:
        described["metrics"].pop(field)
    if not sft.quantize.enabled:
        described.pop("quantize", None)
    # Checkpoint settings change the trained weights only through an initial load.
    if sft.checkpoint.initial_load_path is None and sft.checkpoint.initial_load_hf is None:
        described.pop("checkpoint", None)
    # Bumped when the data a config names changes under it (2: add problems' split follows
    # the RL addition task's), so a warm start trained on the old data is not reused.
    described["warmstart_data_version"] = 2
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "_-" else "_" for c in name)
    folder = Path(cfg.policy.cache_dir).expanduser() / "warmstart" / f"{safe}-{key}"
    return sft, folder


def prepare_policy(cfg: RLConfig, *, log: Log = print) -> None:
    """Train the SFT warm start of `cfg.policy` if it is not cached yet (nothing for other
    kinds of `policy.init`). Progress lines go to `log`.

    Raises:
        ValueError: the SFT config is unknown or invalid.
    """
    if cfg.policy.kind != "sft":
        return
    from tidal.train.config_parse import apply_overrides
    from tidal.train.trainer import Trainer

    sft, folder = sft_run(cfg)
    final = folder / "checkpoint" / f"step-{sft.training.steps}"
    if _complete(final):
        log(f"warm start: reusing the cached SFT checkpoint {final}")
        return
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    run = apply_overrides(
        sft,
        [
            "--job.output_dir",
            str(partial),
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            str(sft.training.steps),
            "--checkpoint.keep_latest_k",
            "1",
            "--checkpoint.last_save_model_only",
            "true",
            "--sample.max_new_tokens",
            "0",
        ],
    )
    t = sft.training
    log(
        f"warm start: SFT {cfg.policy.source} for {t.steps} steps (cached for later runs in "
        f"{folder})"
    )
    trainer = Trainer(run, log=log)
    try:
        last = trainer.train()
    finally:
        trainer.close()
    if last.get("interrupted"):
        raise KeyboardInterrupt
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    log(f"warm start: SFT done in {last.get('elapsed_s', 0):.0f}s, loss {last.get('loss', 0):.3f}")


def policy_tokenizer(spec: str, cfg: RLConfig) -> Tokenizer:
    """The tokenizer `spec` names, as `policy.tokenizer` does: "sft:NAME" for that training
    config's (built in `policy.cache_dir` when not cached yet), or a tokenizer.json path.

    Raises:
        FileNotFoundError: no such file."""
    if spec.startswith("sft:"):
        from tidal.train.config_parse import apply_overrides
        from tidal.train.configs import get_config

        sft = apply_overrides(get_config(spec[4:]), ["--data.cache_dir", cfg.policy.cache_dir])
        return build_tokenizer(sft.data, log=lambda _line: None)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"policy.tokenizer: no file {path}")
    return Tokenizer.from_file(path)


def _complete(path: Path) -> bool:
    from tidal.train.checkpoint.layout import is_checkpoint

    return is_checkpoint(path)


def _newest_step(path: Path) -> Path:
    if _complete(path):
        return path
    steps = sorted(
        (int(p.name.removeprefix("step-")), p)
        for p in path.glob("step-*")
        if p.name.removeprefix("step-").isdigit() and _complete(p)
    )
    if not steps:
        raise FileNotFoundError(f"policy.init: {path} is no complete checkpoint nor holds one")
    return steps[-1][1]
