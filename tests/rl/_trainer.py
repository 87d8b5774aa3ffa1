"""Shared pieces of the trainer-side RL tests: a Trainer without a data pipeline, random
rollouts, and the hand-written reference step (plain forward, F.log_softmax, policy_loss over
the whole batch at once, autograd)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from tidal.models import Transformer, get_flavor
from tidal.rl.loss import LossConfig, policy_loss
from tidal.rl.rollout import RolloutBatch
from tidal.train.config_parse import apply_overrides
from tidal.train.configs import get_config
from tidal.train.data import Batch, DataBundle
from tidal.train.loss import IGNORE_INDEX

VOCAB = 512
TOKENIZER = SimpleNamespace(vocab_size=VOCAB, bos_id=0, eos_id=1)


def rl_config(out_dir, *extra: str):
    """fp32 CPU `tiny` model, no clipping, no sampling, nothing written but the run lock."""
    return apply_overrides(
        get_config("debug"),
        [
            "--job.output_dir",
            str(out_dir),
            "--job.device",
            "cpu",
            "--model.flavor",
            "tiny",
            "--model.vocab_size",
            str(VOCAB),
            "--training.mixed_precision",
            "fp32",
            "--training.max_norm",
            "0",
            "--training.seq_len",
            "32",
            "--training.batch_size",
            "4",
            "--optimizer.lr",
            "1e-2",
            "--lr_scheduler.warmup_steps",
            "0",
            "--metrics.val_every",
            "0",
            "--sample.max_new_tokens",
            "0",
            *extra,
        ],
    )


def no_data() -> DataBundle:
    return DataBundle(tokenizer=TOKENIZER, train=None, val=None)  # type: ignore[arg-type]


def random_rollout(seed: int = 0, n: int = 6, max_prompt: int = 9, max_new: int = 12):
    """Random prompts and completions of several lengths, rewards in two groups; the
    'generator' log-probs are random (they only enter as old/gen log-probs)."""
    g = torch.Generator().manual_seed(seed)
    P, C = max_prompt, max_new
    plen = torch.randint(1, P + 1, (n,), generator=g)
    clen = torch.randint(1, C + 1, (n,), generator=g)
    clen[0] = C  # one full-length completion
    prompt_ids = torch.zeros(n, P, dtype=torch.long)
    completion_ids = torch.zeros(n, C, dtype=torch.long)
    mask = torch.zeros(n, C, dtype=torch.bool)
    for i in range(n):
        prompt_ids[i, : plen[i]] = torch.randint(2, VOCAB, (int(plen[i]),), generator=g)
        completion_ids[i, : clen[i]] = torch.randint(2, VOCAB, (int(clen[i]),), generator=g)
        mask[i, : clen[i]] = True
    logprobs = torch.where(mask, -3 * torch.rand(n, C, generator=g), 0.0)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_lens=plen,
        completion_ids=completion_ids,
        completion_mask=mask,
        logprobs=logprobs,
        sampling_logprobs=torch.zeros(n, C),
        versions=torch.where(mask, 0, -1),
        rewards=torch.rand(n, generator=g).round(),
        group_ids=torch.arange(n) // 3,
        format_ok=torch.ones(n, dtype=torch.bool),
        truncated=torch.zeros(n, dtype=torch.bool),
        answers=[None] * n,
        task="test",
    )


def seed_model(seq_len: int = 512) -> Transformer:
    """The trainer's initial weights (seed 0), as one plain module."""
    with torch.device("meta"):
        model = Transformer(get_flavor("tiny", vocab_size=VOCAB))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def concat(batches: list[Batch]) -> Batch:
    keys = batches[0].extras
    return Batch(
        input_ids=torch.cat([b.input_ids for b in batches]),
        labels=torch.cat([b.labels for b in batches]),
        document_ids=torch.cat([b.document_ids for b in batches]),
        extras={k: torch.cat([b.extras[k] for b in batches]) for k in keys},
    )


def reference_step(model: Transformer, batch: Batch, cfg: LossConfig):
    """The loss, metrics and gradients of one whole batch, written plainly."""
    model.zero_grad(set_to_none=True)
    logits = model(batch.input_ids)
    logp_BTV = F.log_softmax(logits.float(), dim=-1)
    valid = batch.labels != IGNORE_INDEX
    logp = torch.where(valid, logp_BTV.gather(2, batch.labels.clamp(min=0)[..., None])[..., 0], 0)
    entropy = -(logp_BTV.exp() * logp_BTV).sum(-1).detach()
    x = batch.extras
    loss, metrics = policy_loss(
        logp,
        x["old_logprobs"],
        x["advantages"],
        x["mask"],
        cfg,
        ref_logprobs=x.get("ref_logprobs") if cfg.kl_coef else None,
        gen_logprobs=x["gen_logprobs"] if cfg.tis_cap else None,
        entropy=entropy,
    )
    # The generator-trainer log-prob gap PolicyLoss reports.
    gap = torch.where(x["mask"], (logp.detach() - x["gen_logprobs"]).abs(), 0.0)
    metrics["logprob_diff_max"] = gap.amax()
    metrics["logprob_diff_mean"] = gap.sum() / x["mask"].sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), metrics, grads


def capture_grads(trainer) -> dict[str, torch.Tensor]:
    """Fills the returned dict with every parameter's full gradient each time the trainer's
    optimizer steps (a collective for DTensor gradients: every rank steps)."""
    grads: dict[str, torch.Tensor] = {}
    step = trainer.optimizer.step

    def capturing(*args, **kwargs):
        for m in trainer.modules:
            for name, p in m.named_parameters():
                g = p.grad
                grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
        return step(*args, **kwargs)

    trainer.optimizer.step = capturing
    return grads
