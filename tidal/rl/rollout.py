"""The rollout batch: what generators send the trainer through the store.

Shapes: N samples (completions), P the longest prompt, C the longest completion; every
tensor is right-padded. A group is the samples of one prompt (GRPO's group).

Lifecycle: a generator process calls `Generator.generate`, grades each sample with its
task, builds `RolloutBatch.from_samples(...)` and puts `batch.to_state_dict()` into the
store (`store.put_state_dict(sd, "rollouts/<generator>", ...)`); the trainer process gets
state dicts, rebuilds them with `RolloutBatch.from_state_dict` (which checks them), joins
several with `RolloutBatch.concat`, computes advantages from `rewards` and `group_ids`
(tidal/rl/loss.py), and scores `token_ids()` with its own forward.

Versions: every completion token carries the policy version that produced it
(`versions`, from `Sample.versions`, or `Sample.weight_version` for every token when the
weights did not change during the sample); in async mode one sample may span versions. -1
stands for padding and unversioned weights.

Routing replay (mixture-of-experts policies, `loss.routing_replay`): `prompt_experts` and
`completion_experts` carry the experts the generator's MoE layers routed every token it ran
to (`Sample.routed_experts`), in the prompt and completion layouts; the trainer's forward
replays them (tidal/rl/trainer_inputs.py). Absent (None) otherwise, and the state dict is
then unchanged.

Multi-turn trajectories (tidal/rl/envs) use the same layout: the completion is every token
after the opening prompt, sampled turns and the environment's observations alike, and
`loss_mask` is true only on the sampled ones (observations carry log-prob 0 and version -1).
Single-turn batches leave it None: every completion token is trained on (`train_mask`).
Their routing records (`Trajectory.routed_experts`) pack as a sample's do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tidal.generate import Sample
from tidal.rl.tasks.base import Grade

SCHEMA = 1
"""Version of the state-dict layout; `from_state_dict` refuses others."""
MAX_ANSWER_CHARS = 256
"""Parsed answers are cut to this many characters in the batch (the store carries plain
values of at most 1 MB a version)."""

_TENSORS_NC = {
    "completion_ids": torch.int64,
    "completion_mask": torch.bool,
    "logprobs": torch.float32,
    "sampling_logprobs": torch.float32,
    "versions": torch.int64,
}
_EXPERTS = ("prompt_experts", "completion_experts")
EXPERT_DTYPES = (torch.uint8, torch.int16)
"""Dtypes of routing records (`tidal.models.moe.expert_dtype`)."""
_TENSORS_N = {
    "prompt_lens": torch.int64,
    "rewards": torch.float32,
    "group_ids": torch.int64,
    "format_ok": torch.bool,
    "truncated": torch.bool,
}


def _rows(rows: Sequence[Sequence[Any]], fill: Any, dtype: torch.dtype) -> torch.Tensor:
    """[len(rows), longest row]: each row left-aligned, the rest `fill`."""
    out = torch.full((len(rows), max((len(r) for r in rows), default=0)), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


@dataclass(kw_only=True, slots=True)
class RolloutBatch:
    """Graded samples as right-padded tensors, plus plain metadata.

    Example::

        groups = generator.generate([tok.encode(p) for p, _ in problems], params)
        samples = [s for g in groups for s in g]
        grades = [task.grade(s.text, problems[s.prompt_index].reference) for s in samples]
        batch = RolloutBatch.from_samples(samples, grades, task=task.name)
        store.put_state_dict(batch.to_state_dict(), "rollouts", version=step)
    """

    prompt_ids: torch.Tensor
    """[N, P] int64, `pad_id` after each prompt."""
    prompt_lens: torch.Tensor
    """[N] int64."""
    completion_ids: torch.Tensor
    """[N, C] int64, `pad_id` after each completion."""
    completion_mask: torch.Tensor
    """[N, C] bool: true on completion tokens."""
    logprobs: torch.Tensor
    """[N, C] float32: the generator's log-prob of each token (temperature 1, no truncation:
    what the trainer's forward computes); 0 at padding."""
    sampling_logprobs: torch.Tensor
    """[N, C] float32: log-probs under the distribution sampled (after temperature and
    truncation); 0 at padding and for greedy decoding."""
    versions: torch.Tensor
    """[N, C] int64: the policy version that produced each token; -1 at padding or when the
    weights were unversioned."""
    rewards: torch.Tensor
    """[N] float32 in [0, 1]."""
    group_ids: torch.Tensor
    """[N] int64: samples of one prompt share an id (unique within the batch)."""
    format_ok: torch.Tensor
    """[N] bool: the grader found the answer in the task's format."""
    truncated: torch.Tensor
    """[N] bool: the completion hit max_new_tokens (finish reason "length")."""
    answers: list[str | None]
    """The graders' parsed answers (at most MAX_ANSWER_CHARS characters), None for none."""
    task: str
    """The task's registered name."""
    pad_id: int = 0
    loss_mask: torch.Tensor | None = None
    """[N, C] bool: the completion tokens trained on (the sampled ones of a multi-turn
    trajectory, not its observations), a subset of `completion_mask`; None: all of them."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Plain values (str, int, float, bool, None, lists and string-keyed dicts) the producer
    adds: a generator id, a seed, timings."""
    prompt_experts: torch.Tensor | None = None
    """[N, L, P, K] uint8 (int16 past 256 experts): the experts MoE layer l routed prompt
    token p to in the generator (L MoE layers, top-k K, in top-k order); 0 at padding. With
    `completion_experts`; None without routing records."""
    completion_experts: torch.Tensor | None = None
    """[N, L, C, K]: the same for completion token c, fed to the model to sample token c + 1
    (the last completion token never is: its entry, as padding's, is 0)."""

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_ids, torch.Tensor) or self.prompt_ids.dim() != 2:
            got = getattr(self.prompt_ids, "shape", type(self.prompt_ids))
            raise ValueError(f"RolloutBatch.prompt_ids must be a [N, P] tensor, got {got}")
        N, P = self.prompt_ids.shape
        C = self.completion_ids.shape[-1] if self.completion_ids.dim() == 2 else -1
        for name, dtype in _TENSORS_NC.items():
            _check_tensor(name, getattr(self, name), (N, C), dtype)
        for name, dtype in _TENSORS_N.items():
            _check_tensor(name, getattr(self, name), (N,), dtype)
        _check_tensor("prompt_ids", self.prompt_ids, (N, P), torch.int64)
        if len(self.answers) != N:
            raise ValueError(f"answers must hold {N} entries, got {len(self.answers)}")
        if self.loss_mask is not None:
            _check_tensor("loss_mask", self.loss_mask, (N, C), torch.bool)
            if bool((self.loss_mask & ~self.completion_mask).any()):
                raise ValueError("RolloutBatch.loss_mask must be false outside completion_mask")
        self._check_experts(N, P, C)

    def _check_experts(self, N: int, P: int, C: int) -> None:
        pe, ce = self.prompt_experts, self.completion_experts
        if pe is None and ce is None:
            return
        if pe is None or ce is None:
            raise ValueError("RolloutBatch.prompt_experts and completion_experts come together")
        for name, t, width in (("prompt_experts", pe, P), ("completion_experts", ce, C)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.dtype not in EXPERT_DTYPES:
                got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else t
                raise ValueError(
                    f"RolloutBatch.{name} must be a [N, layers, tokens, top_k] tensor of "
                    f"{EXPERT_DTYPES}, got {got}"
                )
            if t.shape[0] != N or t.shape[2] != width:
                raise ValueError(
                    f"RolloutBatch.{name} has shape {tuple(t.shape)}; the batch needs "
                    f"[{N}, layers, {width}, top_k]"
                )
        if pe.shape[1] != ce.shape[1] or pe.shape[3] != ce.shape[3] or pe.dtype != ce.dtype:
            raise ValueError(
                f"RolloutBatch.prompt_experts {tuple(pe.shape)} {pe.dtype} and "
                f"completion_experts {tuple(ce.shape)} {ce.dtype} differ in layers, top_k or dtype"
            )

    @property
    def train_mask(self) -> torch.Tensor:
        """[N, C] bool: the tokens the loss sees (`loss_mask`, else `completion_mask`)."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def from_samples(
        cls,
        samples: Sequence[Sample],
        grades: Sequence[Grade],
        *,
        task: str,
        group_ids: Sequence[int] | None = None,
        pad_id: int = 0,
        meta: Mapping[str, Any] | None = None,
    ) -> RolloutBatch:
        """Pack graded samples.

        Args:
            samples: from `Generator.generate` (flattened over prompts).
            grades: one per sample, in order.
            task: the task's name.
            group_ids: one per sample; default each sample's `prompt_index` (the samples of
                one `generate` call).
            pad_id: the id padding prompts and completions.
            meta: plain values to carry along.

        Raises:
            ValueError: no samples, or `grades` / `group_ids` of another length.
        """
        N = len(samples)
        if N == 0:
            raise ValueError("a RolloutBatch needs at least one sample")
        if len(grades) != N:
            raise ValueError(f"got {N} samples and {len(grades)} grades")
        if group_ids is None:
            group_ids = [s.prompt_index for s in samples]
        if len(group_ids) != N:
            raise ValueError(f"got {N} samples and {len(group_ids)} group ids")
        for i, s in enumerate(samples):
            c = len(s.completion_ids)
            if len(s.logprobs) != c or len(s.sampling_logprobs) != c:
                raise ValueError(
                    f"sample {i}: {c} completion tokens but {len(s.logprobs)} logprobs and "
                    f"{len(s.sampling_logprobs)} sampling_logprobs"
                )
            if s.versions is not None and len(s.versions) != c:
                raise ValueError(
                    f"sample {i}: {c} completion tokens but {len(s.versions)} versions"
                )
        prompt_ids = _rows([s.prompt_ids for s in samples], pad_id, torch.int64)
        completion_ids = _rows([s.completion_ids for s in samples], pad_id, torch.int64)
        P, C = prompt_ids.shape[1], completion_ids.shape[1]
        mask = _rows([[True] * len(s.completion_ids) for s in samples], False, torch.bool)
        logprobs = _rows([s.logprobs for s in samples], 0.0, torch.float32)
        sampling_logprobs = _rows([s.sampling_logprobs for s in samples], 0.0, torch.float32)
        # Per-token versions, else the one version of the weights that sampled it all.
        versions = _rows(
            [
                s.versions
                if s.versions is not None
                else [-1 if s.weight_version is None else s.weight_version] * len(s.completion_ids)
                for s in samples
            ],
            -1,
            torch.int64,
        )
        experts = _pack_experts(
            [(len(s.prompt_ids), len(s.completion_ids), s.routed_experts, -1) for s in samples],
            P,
            C,
            "sample",
        )
        return cls(
            prompt_ids=prompt_ids,
            prompt_lens=torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.int64),
            completion_ids=completion_ids,
            completion_mask=mask,
            logprobs=logprobs,
            sampling_logprobs=sampling_logprobs,
            versions=versions,
            rewards=torch.tensor([g.reward for g in grades], dtype=torch.float32),
            group_ids=torch.tensor(list(group_ids), dtype=torch.int64),
            format_ok=torch.tensor([g.format_ok for g in grades], dtype=torch.bool),
            truncated=torch.tensor([s.finish_reason == "length" for s in samples]),
            answers=[None if g.answer is None else g.answer[:MAX_ANSWER_CHARS] for g in grades],
            task=task,
            pad_id=pad_id,
            meta=dict(meta or {}),
            **experts,
        )

    @classmethod
    def from_trajectories(
        cls,
        trajectories: Sequence[Any],
        *,
        task: str,
        group_ids: Sequence[int],
        pad_id: int = 0,
        meta: Mapping[str, Any] | None = None,
    ) -> RolloutBatch:
        """Pack multi-turn trajectories (tidal.rl.envs.Trajectory): the opening prompt as the
        prompt, every later token as the completion, `loss_mask` on the sampled ones, the
        trajectory's reward, answer and truncation, and its routing records
        (`Trajectory.routed_experts`) as `prompt_experts` / `completion_experts`. Positions
        a trajectory never ran (the tail after its last sampled turn: nothing trained on
        follows them) get experts 0..top_k-1.

        Raises:
            ValueError: no trajectories, `group_ids` of another length, a trajectory whose
                per-token lists differ in length, or routing records on some trajectories and
                not others, of another layout, or not covering a sampled token's inputs.
        """
        N = len(trajectories)
        if N == 0:
            raise ValueError("a RolloutBatch needs at least one trajectory")
        if len(group_ids) != N:
            raise ValueError(f"got {N} trajectories and {len(group_ids)} group ids")
        for i, t in enumerate(trajectories):
            c = len(t.completion_ids)
            per_token = (t.loss_mask, t.logprobs, t.sampling_logprobs, t.versions)
            if any(len(x) != c for x in per_token):
                raise ValueError(
                    f"trajectory {i}: {c} completion tokens but per-token lists of lengths "
                    f"{[len(x) for x in per_token]} (loss_mask, logprobs, sampling_logprobs, "
                    "versions)"
                )
        prompt_ids = _rows([t.prompt_ids for t in trajectories], pad_id, torch.int64)
        completion_ids = _rows([t.completion_ids for t in trajectories], pad_id, torch.int64)
        mask = _rows([[True] * len(t.completion_ids) for t in trajectories], False, torch.bool)
        loss_mask = _rows([t.loss_mask for t in trajectories], False, torch.bool)
        logprobs = _rows([t.logprobs for t in trajectories], 0.0, torch.float32)
        sampling_logprobs = _rows([t.sampling_logprobs for t in trajectories], 0.0, torch.float32)
        versions = _rows([t.versions for t in trajectories], -1, torch.int64)
        experts = _pack_experts(
            [
                (len(t.prompt_ids), len(t.completion_ids), t.routed_experts, _inputs_needed(t))
                for t in trajectories
            ],
            prompt_ids.shape[1],
            completion_ids.shape[1],
            "trajectory",
        )
        return cls(
            prompt_ids=prompt_ids,
            prompt_lens=torch.tensor([len(t.prompt_ids) for t in trajectories], dtype=torch.int64),
            completion_ids=completion_ids,
            completion_mask=mask,
            logprobs=logprobs,
            sampling_logprobs=sampling_logprobs,
            versions=versions,
            rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
            group_ids=torch.tensor(list(group_ids), dtype=torch.int64),
            format_ok=torch.tensor([t.format_ok for t in trajectories], dtype=torch.bool),
            truncated=torch.tensor([t.truncated for t in trajectories], dtype=torch.bool),
            answers=[
                None if t.answer is None else t.answer[:MAX_ANSWER_CHARS] for t in trajectories
            ],
            task=task,
            pad_id=pad_id,
            loss_mask=loss_mask,
            meta=dict(meta or {}),
            **experts,
        )

    # -- through the store ------------------------------------------------------------------

    def to_state_dict(self) -> dict[str, Any]:
        """Tensors and plain values for `store.put_state_dict` (no pickling anywhere)."""
        sd: dict[str, Any] = {
            "schema": SCHEMA,
            "task": self.task,
            "pad_id": self.pad_id,
            "answers": list(self.answers),
            "meta": dict(self.meta),
        }
        for name in ("prompt_ids", *_TENSORS_N, *_TENSORS_NC):
            sd[name] = getattr(self, name)
        if self.loss_mask is not None:  # multi-turn only: single-turn state dicts unchanged
            sd["loss_mask"] = self.loss_mask
        if self.prompt_experts is not None:  # routing records only: others unchanged
            sd["prompt_experts"] = self.prompt_experts
            sd["completion_experts"] = self.completion_experts
        return sd

    @classmethod
    def from_state_dict(cls, sd: Mapping[str, Any]) -> RolloutBatch:
        """The batch `to_state_dict` described, checked (keys, shapes, dtypes, lengths).

        Raises:
            ValueError: another schema, a missing key, or inconsistent shapes or dtypes.
        """
        if sd.get("schema") != SCHEMA:
            raise ValueError(f"rollout state dict schema {sd.get('schema')!r}, expected {SCHEMA}")
        names = ("prompt_ids", *_TENSORS_N, *_TENSORS_NC, "answers", "task", "pad_id", "meta")
        missing = [k for k in names if k not in sd]
        if missing:
            raise ValueError(f"rollout state dict lacks {missing}")
        if not isinstance(sd["task"], str) or not isinstance(sd["pad_id"], int):
            raise ValueError("rollout state dict: 'task' must be a str and 'pad_id' an int")
        if not isinstance(sd["answers"], list) or not isinstance(sd["meta"], dict):
            raise ValueError("rollout state dict: 'answers' must be a list and 'meta' a dict")
        return cls(
            **{k: sd[k] for k in names},
            loss_mask=sd.get("loss_mask"),
            prompt_experts=sd.get("prompt_experts"),
            completion_experts=sd.get("completion_experts"),
        )

    # -- for the trainer --------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return self.prompt_ids.shape[0]

    def token_ids(self) -> torch.Tensor:
        """[N, L] each prompt followed by its completion, right-padded (L = the longest
        prompt + completion): the input of the trainer's forward."""
        comp_lens = self.completion_mask.sum(1)
        L = int((self.prompt_lens + comp_lens).max()) if len(comp_lens) else 0
        N, C = self.completion_ids.shape
        ids = torch.full((N, L), self.pad_id, dtype=torch.int64)
        for i in range(N):
            p, c = int(self.prompt_lens[i]), int(comp_lens[i])
            ids[i, :p] = self.prompt_ids[i, :p]
            ids[i, p : p + c] = self.completion_ids[i, :c]
        return ids

    def completion_values(self, per_position: torch.Tensor) -> torch.Tensor:
        """[N, C] the completion tokens' entries of a per-position tensor [N, L - 1] computed
        on `token_ids()`, such as `tidal.generate.logprobs(model, batch.token_ids())` (where column
        j scores token j + 1); 0 at padding and observations (outside `train_mask`).
        Differentiable.

        Example::

            new_lp = batch.completion_values(logprobs(model, batch.token_ids()))
        """
        N, C = self.completion_ids.shape
        # Completion token k of row i sits at position prompt_len + k; its score in column
        # prompt_len + k - 1.
        idx_NC = (self.prompt_lens[:, None] - 1 + torch.arange(C)).to(per_position.device)
        idx_NC = idx_NC.clamp(max=per_position.shape[1] - 1)
        vals = per_position.gather(1, idx_NC)
        return torch.where(self.train_mask.to(per_position.device), vals, 0.0)

    def select(self, rows: torch.Tensor | Sequence[int]) -> RolloutBatch:
        """The samples at `rows` (indices, or a [N] bool mask such as
        `group_advantages(...).keep`), widths unchanged."""
        if not isinstance(rows, torch.Tensor):
            rows = torch.tensor(list(rows), dtype=torch.int64)
        if rows.dtype == torch.bool:
            rows = rows.nonzero()[:, 0]
        idx = rows.tolist()
        tensors = {n: getattr(self, n)[rows] for n in ("prompt_ids", *_TENSORS_N, *_TENSORS_NC)}
        loss_mask = None if self.loss_mask is None else self.loss_mask[rows]
        for name in _EXPERTS:
            t = getattr(self, name)
            tensors[name] = None if t is None else t[rows]
        return replace(
            self,
            answers=[self.answers[i] for i in idx],
            meta=dict(self.meta),
            loss_mask=loss_mask,
            **tensors,
        )

    @classmethod
    def concat(cls, batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """One batch of several (from several generators): padded to the widest, group ids
        renumbered 0.. so groups of different batches never merge; `meta` of the first.

        Raises:
            ValueError: no batches, or batches of different tasks or pad ids.
        """
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for b in batches[1:]:
            if (b.task, b.pad_id) != (first.task, first.pad_id):
                raise ValueError(
                    f"cannot concat batches of task/pad_id {(first.task, first.pad_id)} and "
                    f"{(b.task, b.pad_id)}"
                )
        P = max(b.prompt_ids.shape[1] for b in batches)
        C = max(b.completion_ids.shape[1] for b in batches)
        fills = {"prompt_ids": first.pad_id, "completion_ids": first.pad_id, "versions": -1}
        out: dict[str, Any] = {}
        for name in ("prompt_ids", *_TENSORS_NC):
            width = P if name == "prompt_ids" else C
            parts = []
            for b in batches:
                t = getattr(b, name)
                pad = width - t.shape[1]
                parts.append(torch.cat([t, t.new_full((t.shape[0], pad), fills.get(name, 0))], 1))
            out[name] = torch.cat(parts)
        for name in _TENSORS_N:
            out[name] = torch.cat([getattr(b, name) for b in batches])
        offset, groups = 0, []
        for b in batches:
            _, inverse = torch.unique(b.group_ids, return_inverse=True)
            groups.append(inverse + offset)
            offset += int(inverse.max()) + 1 if inverse.numel() else 0
        out["group_ids"] = torch.cat(groups)
        if any(b.loss_mask is not None for b in batches):
            parts = []
            for b in batches:
                t = b.train_mask
                parts.append(torch.cat([t, t.new_zeros((t.shape[0], C - t.shape[1]))], 1))
            out["loss_mask"] = torch.cat(parts)
        recorded = [b.prompt_experts is not None for b in batches]
        if any(recorded):
            if not all(recorded):
                raise ValueError("cannot concat batches with and without routing records")
            for name, width in (("prompt_experts", P), ("completion_experts", C)):
                parts = []
                for b in batches:
                    t = getattr(b, name)
                    pad = t.new_zeros((*t.shape[:2], width - t.shape[2], t.shape[3]))
                    parts.append(torch.cat([t, pad], 2))
                out[name] = torch.cat(parts)
        answers = [a for b in batches for a in b.answers]
        return cls(
            **out, answers=answers, task=first.task, pad_id=first.pad_id, meta=dict(first.meta)
        )

    def stats(self) -> dict[str, float]:
        """Means for logging: reward, format-ok, answered and truncated rates, completion
        length, and the policy versions' range ({} for an empty batch)."""
        if self.num_samples == 0:
            return {}
        lens = self.completion_mask.sum(1).float()
        v = self.versions[self.completion_mask]
        return {
            "reward_mean": float(self.rewards.mean()),
            "format_ok_rate": float(self.format_ok.float().mean()),
            "answered_rate": sum(a is not None for a in self.answers) / self.num_samples,
            "truncated_rate": float(self.truncated.float().mean()),
            "completion_len_mean": float(lens.mean()),
            "version_min": float(v.min()) if v.numel() else -1.0,
            "version_max": float(v.max()) if v.numel() else -1.0,
        }


def _inputs_needed(t: Any) -> int:
    """The input positions a trajectory's sampled tokens are scored from: the prompt and the
    completion up to its last sampled token (0 without one)."""
    last = max((k for k, m in enumerate(t.loss_mask) if m), default=None)
    return 0 if last is None else len(t.prompt_ids) + last


def _pack_experts(
    rows: Sequence[tuple[int, int, torch.Tensor | None, int]],
    P: int,
    C: int,
    what: str,
) -> dict[str, torch.Tensor]:
    """`prompt_experts` and `completion_experts` of rows (prompt length, completion length,
    routing records [layers, positions, top_k] or None, and the fewest positions the records
    may cover, -1 for all of them, prompt + completion - 1, as `Sample.routed_experts`
    does), {} when no row has records. Positions past a row's records get experts
    0..top_k-1; padding 0.

    Raises:
        ValueError: some rows have records and others not, or records of another length,
            layer count, top-k or dtype (naming the row as `what` i)."""
    recs = [row[2] for row in rows]
    first = next((r for r in recs if r is not None), None)
    if first is None:
        return {}
    L, K = first.shape[0], first.shape[2]
    pe = torch.zeros(len(rows), L, P, K, dtype=first.dtype)
    ce = torch.zeros(len(rows), L, C, K, dtype=first.dtype)
    filler_K = torch.arange(K, dtype=first.dtype)
    for i, row in enumerate(rows):
        p, c, r, least = row
        most = max(p + c - 1, 0)
        least = most if least < 0 else least
        if r is None:
            if least > 0:
                raise ValueError(
                    f"{what} {i} carries no routing records (routed_experts) and others do"
                )
            r = first.new_zeros((L, 0, K))
        bad = r.dim() != 3 or (r.shape[0], r.shape[2]) != (L, K) or r.dtype != first.dtype
        if bad or not least <= r.shape[1] <= most:
            span = f"{most}" if least == most else f"{least} to {most}"
            raise ValueError(
                f"{what} {i}: routed_experts {r.dtype} of shape {tuple(r.shape)}, expected "
                f"{first.dtype} of shape ({L}, {span}, {K}) (layers, prompt + completion - 1 "
                "positions, top_k)"
            )
        row_LTK = torch.cat([r, filler_K.expand(L, most - r.shape[1], K)], 1)
        pe[i, :, : min(p, row_LTK.shape[1])] = row_LTK[:, :p]
        ce[i, :, : max(most - p, 0)] = row_LTK[:, p:]
    return {"prompt_experts": pe, "completion_experts": ce}


def _check_tensor(name: str, t: Any, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"RolloutBatch.{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(
            f"RolloutBatch.{name} must be {dtype} of shape {shape}, got {t.dtype} of "
            f"shape {tuple(t.shape)}"
        )
