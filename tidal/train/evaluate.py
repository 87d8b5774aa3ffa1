"""Greedy exact-match evaluation of a chat model on problems with a known answer.

`exact_match(model, encoder, problems)` prompts the model with each problem's user turn through
the chat template it was trained with, decodes greedily until an end-of-turn token, reads the
final answer with `arithmetic.parse_answer` (the number after `####`) and counts the matches.
Prompts of equal token length run as one batch with a KV cache, so no padding is needed.

A stopgap for the SFT demo: the RL layer's batched generator (tidal/rl) replaces the decoding
loop; the answer parsing is the graders' own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tidal.models.kv_cache import KVCache
from tidal.models.transformer import Transformer
from tidal.train.data.arithmetic import Problem, parse_answer
from tidal.train.data.chat import ChatEncoder, Messages


@dataclass(kw_only=True, slots=True)
class EvalResult:
    accuracy: float
    """Fraction of problems whose parsed final answer equals the true one."""
    correct: int
    total: int
    completions: list[str]
    """The decoded answers, in the order of the problems."""


@torch.no_grad()
def greedy_complete(
    model: Transformer,
    encoder: ChatEncoder,
    prompts: Sequence[Messages],
    *,
    max_new_tokens: int = 128,
    batch_size: int = 64,
) -> list[str]:
    """The greedy assistant reply to each prompt (a list of messages), cut at the end of the
    turn. `model` is put in eval mode and left there."""
    model.eval()
    device = model.rope.device
    tok = encoder.tokenizer
    ids = [encoder.prompt_ids(p) for p in prompts]
    by_len: dict[int, list[int]] = {}
    for i, x in enumerate(ids):
        by_len.setdefault(len(x), []).append(i)
    out: list[str] = [""] * len(prompts)
    stop_B = torch.tensor(sorted(encoder.stop_ids), device=device)
    for length, members in sorted(by_len.items()):
        capacity = min(model.args.max_seq_len, length + max_new_tokens)
        for start in range(0, len(members), batch_size):
            rows = members[start : start + batch_size]
            cache = KVCache.for_model(model, batch_size=len(rows), capacity=capacity)
            tokens_BT = torch.tensor([ids[i] for i in rows], device=device)
            new: list[torch.Tensor] = []
            done_B = torch.zeros(len(rows), dtype=torch.bool, device=device)
            for _ in range(capacity - length):
                logits_BTV = model.forward_cached(tokens_BT, cache)
                cache.advance(tokens_BT.shape[1])
                next_B = logits_BTV[:, -1].argmax(dim=-1)
                new.append(next_B)
                done_B |= torch.isin(next_B, stop_B)
                if bool(done_B.all()):
                    break
                tokens_BT = next_B[:, None]
            gen_BN = torch.stack(new, dim=1).tolist()
            for row, i in enumerate(rows):
                seq = gen_BN[row]
                cut = next((k for k, t in enumerate(seq) if t in encoder.stop_ids), len(seq))
                text = tok.decode(seq[:cut])
                if encoder.stop_text and encoder.stop_text in text:
                    text = text[: text.index(encoder.stop_text)]
                out[i] = text
    return out


def exact_match(
    model: Transformer,
    encoder: ChatEncoder,
    problems: Sequence[Problem],
    *,
    max_new_tokens: int = 128,
    batch_size: int = 64,
) -> EvalResult:
    """Greedy exact-match accuracy of the final answers (`#### N`) on `problems`."""
    prompts = [p.messages()[:1] for p in problems]
    completions = greedy_complete(
        model, encoder, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size
    )
    correct = sum(parse_answer(c) == p.answer for c, p in zip(completions, problems, strict=True))
    total = len(problems)
    return EvalResult(
        accuracy=correct / max(total, 1), correct=correct, total=total, completions=completions
    )
