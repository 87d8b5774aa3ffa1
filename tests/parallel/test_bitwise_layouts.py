"""Bitwise log-prob parity across trainer/generator layouts in batch-invariant mode.

Each rank scores a batch with `tidal.generate.logprobs(..., batch_invariant=True)` through a
sharded `tiny` model (fp32, CPU, gloo) and compares, bit for bit, with what one process and
the unsharded model give for every row scored alone (the generator's side: in batch-invariant
mode a row's log-probs do not depend on the batch, tests/generate/test_batch_invariant.py):

- FSDP2 on 2 ranks against 1 process (each rank scores its own rows);
- TP 2 with sequence parallel (the trainer's plan) against TP 1 (the row-parallel sums
  reduced in a fixed order, tidal/models/batch_invariant_tp.py);
- TP 2 against TP 2: the trainer's batch of 4 against each row alone, and against the TP
  generator's plan (no sequence parallel) on the same ranks.

Each case also checks that every row gives the same bits in a batch and alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel._launch import run_ranks
from tidal.models import Transformer, get_flavor
from tidal.parallel.config import ActivationCheckpointConfig, ParallelismConfig
from tidal.parallel.dims import ParallelDims


def _tokens() -> torch.Tensor:
    return torch.randint(0, 512, (4, 20), generator=torch.Generator().manual_seed(0))


def _rows_alone(model, tokens, lengths):
    """Each row scored alone, cut to its own length (no padding): the generator's view."""
    from tidal.generate import logprobs

    return [logprobs(model, tokens[i : i + 1, :n], batch_invariant=True)[0] for i, n in lengths]


def _score(rank, world, layout):
    import torch.distributed as dist

    from tidal.generate import logprobs
    from tidal.parallel.parallelize import apply_tp, parallelize

    dist.init_process_group("gloo")
    try:
        tokens = _tokens()
        lengths = [(0, 20), (1, 8), (2, 16), (3, 6)]  # even: sequence parallel
        with torch.no_grad():
            single = Transformer(get_flavor("tiny"))
            single.init_weights(seed=3)
            ref = _rows_alone(single, tokens, lengths)

            dims = ParallelDims(
                world_size=world, **{k: v for k, v in layout.items() if k != "loss_parallel"}
            )
            mesh = dims.build_mesh("cpu")
            with torch.device("meta"):
                sharded = Transformer(get_flavor("tiny"))
            parallelize(
                sharded,
                mesh,
                dims,
                ParallelismConfig(**layout),
                ActivationCheckpointConfig(),
                compile=False,
                param_dtype=None,
            )
            sharded.to_empty(device="cpu")
            sharded.init_weights(seed=3)
            dp = dims.dp_shard
            rows = list(range(rank % dp, 4, dp)) if dp > 1 else list(range(4))
            batch = logprobs(sharded, tokens[rows], batch_invariant=True)
            alone = _rows_alone(sharded, tokens, [lengths[r] for r in rows])
            generator = None
            if dims.tp > 1:  # a TP generator's plan: no sequence parallel (one token a step)
                with torch.device("meta"):
                    gen_model = Transformer(get_flavor("tiny"))
                apply_tp(gen_model, mesh["tp"], loss_parallel=False, sequence_parallel=False)
                gen_model.to_empty(device="cpu")
                gen_model.init_weights(seed=3)
                generator = _rows_alone(gen_model, tokens, lengths)
        out = {}
        for j, r in enumerate(rows):
            n = lengths[r][1]
            out[r] = {
                "vs_single": float((batch[j, : n - 1] - ref[r]).abs().max()),
                "alone_vs_single": float((alone[j] - ref[r]).abs().max()),
                "batch_vs_alone": float((batch[j, : n - 1] - alone[j]).abs().max()),
            }
            if generator is not None:
                out[r]["tp_generator_vs_trainer"] = float((generator[r] - alone[j]).abs().max())
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "layout",
    [{"dp_shard": 2}, {"tp": 2, "dp_shard": 1, "loss_parallel": False}],
    ids=["fsdp2_vs_1", "tp2_vs_tp1"],
)
def test_trainer_layout_matches_one_process_bitwise(layout, tmp_path):
    for per_row in run_ranks(2, _score, layout, tmp_path=tmp_path):
        for row, diffs in per_row.items():
            assert diffs == {k: 0.0 for k in diffs}, f"row {row}: {diffs}"
