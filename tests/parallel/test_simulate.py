"""Simulated ranks in one process (torch's LocalTensorMode, tidal/parallel/simulate.py):
tidal's tensor-parallel plan and context parallelism on real text against one process, and
the mode catching ranks that disagree."""

import pytest
import torch

from tidal.models.flavors import get_flavor
from tidal.parallel.simulate import compare_with_one_process, full, simulated_ranks

pytest.importorskip("torch.distributed._local_tensor")


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    """Two rows of 65 byte ids of English prose (the standard library's pydoc topics)."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics)).encode()
    return torch.tensor(list(text[: 2 * 65])).view(2, 65)


@pytest.mark.parametrize(
    "layout",
    [
        {"tp": 2},
        {"tp": 2, "loss_parallel": False},
        {"cp": 2},
        {"cp": 2, "cp_load_balance": False},
        {"tp": 2, "cp": 2},
    ],
    ids=["tp2", "tp2-replicated-logits", "cp2", "cp2-contiguous", "tp2-cp2"],
)
def test_simulated_layout_matches_one_process(layout, tokens):
    diff = compare_with_one_process(get_flavor("tiny"), tokens, **layout)
    # fp32, summed loss over 128 tokens (about 800): only reduction order differs.
    assert diff.loss < 1e-3, diff
    assert diff.logits < 1e-5, diff
    assert diff.grads < 1e-4, diff


def test_a_wrong_layout_shows_up(tokens, monkeypatch):
    # A bug that runs without an error: each cp rank takes a contiguous slice of the tokens
    # but is given the load-balanced positions (RoPE and the mask then see the wrong places).
    from tidal.parallel.context import ContextParallel

    def shard(self, *tensors_BT):
        T = tensors_BT[0].shape[1]
        n = T // self.size
        wrong = torch.arange(self.rank * n, (self.rank + 1) * n)
        return (*(t.index_select(1, wrong) for t in tensors_BT), self.local_index(T, "cpu"))

    monkeypatch.setattr(ContextParallel, "shard", shard)
    diff = compare_with_one_process(get_flavor("tiny"), tokens, cp=2)
    assert diff.logits > 0.1 and diff.grads > 1e-2, diff


def test_full_refuses_ranks_that_disagree():
    from torch.distributed._local_tensor import rank_map

    with simulated_ranks(2):
        same = rank_map(lambda r: torch.ones(3))
        assert torch.equal(full(same), torch.ones(3))
        differs = rank_map(lambda r: torch.full((3,), float(r)))
        with pytest.raises(ValueError, match="ranks 0 and 1 hold different values"):
            full(differs)


def test_bad_arguments_are_named(tokens):
    with pytest.raises(ValueError, match="tp and cp must be >= 1"):
        compare_with_one_process(get_flavor("tiny"), tokens, tp=0)
    with pytest.raises(ValueError, match="do not split into 6 equal chunks"):
        compare_with_one_process(get_flavor("tiny"), tokens, cp=3)
    with simulated_ranks(2), pytest.raises(ValueError, match="without a process group"):
        with simulated_ranks(2):
            pass
