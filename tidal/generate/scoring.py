"""Scoring sequences with the training forward: the log-probs a trainer compares with a
Generator's (`Sample.logprobs`).

Both run the same model code. In batch-invariant mode (tidal/models/batch_invariant.py) a
row's values here are bitwise those the Generator reports for the same tokens; otherwise they
agree up to floating-point reduction order.

Shape legend: B rows, T time, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tidal.generate.sampler import log_softmax
from tidal.generate.types import Sample
from tidal.models.transformer import Transformer


def logprobs(
    model: Transformer, ids_BT: torch.Tensor, *, batch_invariant: bool = False
) -> torch.Tensor:
    """Log-probs [B, T-1] of each next token, log p(ids[:, t+1] | ids[:, :t+1]), computed by
    the model's training forward (causal, no cache) and an fp32 log-softmax.

    With `batch_invariant=True` each row's values are bitwise those the Generator reports
    for the same tokens in batch-invariant mode (same weights, dtype and layout), whatever the
    other rows and the right padding. Run it under the same autocast as the generator.

    Example::

        lp = logprobs(model, torch.tensor([s.prompt_ids + s.completion_ids]))
        completion_lp = lp[0, len(s.prompt_ids) - 1 :]      # == s.logprobs
    """
    logits_BTV = model(ids_BT, batch_invariant=batch_invariant)
    B, T, V = logits_BTV.shape
    logp = log_softmax(logits_BTV[:, :-1].reshape(-1, V), batch_invariant).view(B, T - 1, V)
    return logp.gather(2, ids_BT[:, 1:, None])[..., 0]


def completion_logprobs(
    model: Transformer,
    samples: Sequence[Sample],
    *,
    batch_invariant: bool = False,
    pad_id: int = 0,
) -> list[torch.Tensor]:
    """`logprobs` of every sample's completion tokens, the samples right-padded into one
    batch; returns one tensor per sample, of its completion's length (what the trainer
    compares with `Sample.logprobs`)."""
    seqs = [list(s.prompt_ids) + list(s.completion_ids) for s in samples]
    width = max(len(q) for q in seqs)
    device = model.rope.device
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, q in enumerate(seqs):
        ids[i, : len(q)] = torch.tensor(q)
    lp = logprobs(model, ids.to(device), batch_invariant=batch_invariant)
    return [lp[i, len(s.prompt_ids) - 1 : len(seqs[i]) - 1] for i, s in enumerate(samples)]
