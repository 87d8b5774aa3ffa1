"""Interleaved sources: weights are sampling probabilities, the stopping strategies end epochs
where they say, resuming continues with the same rows, ranks stay disjoint; the config and its
command-line form."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tidal.train.config_parse import apply_overrides, help_text, to_dict
from tidal.train.configs import get_config
from tidal.train.data import DataConfig, InterleavedLoader, PackedLoader, SourceConfig, build_data

T = 4


def source(tag: int, windows: int, *, dp_rank: int = 0, dp_world: int = 1) -> PackedLoader:
    """A stream of `windows` windows whose tokens are tag * 1000 + window index."""
    tokens = np.repeat(tag * 1000 + np.arange(windows + 1), T)[: windows * T + 1]
    return PackedLoader(
        tokens, np.array([0]), seq_len=T, batch_size=1, seed=0, dp_rank=dp_rank, dp_world=dp_world
    )


def rows(loader: InterleavedLoader, n_batches: int) -> list[tuple[int, int]]:
    """(source tag, window) of every row of the next batches."""
    out = []
    for _ in range(n_batches):
        for first in next(loader).input_ids[:, 0].tolist():
            out.append(divmod(first, 1000))
    return out


def test_weights_are_sampling_probabilities() -> None:
    # Source sizes 10x apart, weights 3:1: the mixture follows the weights, not the sizes.
    mix = InterleavedLoader(
        [source(1, 200), source(2, 2000)],
        [3.0, 1.0],
        batch_size=8,
        seed=0,
        stopping_strategy="all_exhausted",
    )
    counts = Counter(tag for tag, _ in rows(mix, 250))
    assert abs(counts[1] / 2000 - 0.75) < 0.04


def test_first_exhausted_ends_the_epoch_without_repeats() -> None:
    mix = InterleavedLoader([source(1, 20), source(2, 60)], [1.0, 1.0], batch_size=1, seed=0)
    seen: list[tuple[int, int]] = []
    while mix.epoch == 0:
        seen.extend(rows(mix, 1))
    assert len(seen) == len(set(seen))  # no window twice within the epoch
    assert sorted(w for tag, w in seen if tag == 1) == list(range(20))  # it ended as 1 ran out
    assert len([w for tag, w in seen if tag == 2]) < 60
    assert seen[-1][0] == 1


def test_all_exhausted_sees_every_window_and_restarts_small_sources() -> None:
    mix = InterleavedLoader(
        [source(1, 5), source(2, 40)],
        [1.0, 1.0],
        batch_size=1,
        seed=3,
        stopping_strategy="all_exhausted",
    )
    seen = []
    while mix.epoch == 0:
        seen.extend(rows(mix, 1))
    assert {w for tag, w in seen if tag == 2} == set(range(40))
    small = Counter(w for tag, w in seen if tag == 1)
    assert set(small) == set(range(5)) and max(small.values()) > 1  # passes repeated
    # The next epoch starts fresh passes in a new order.
    assert rows(mix, 45) != seen[:45]


def test_resume_continues_with_the_same_rows_across_epochs() -> None:
    def make() -> InterleavedLoader:
        sources = [source(1, 7), source(2, 11), source(3, 3)]
        return InterleavedLoader(
            sources, [2.0, 1.0, 1.0], batch_size=3, seed=5, stopping_strategy="all_exhausted"
        )

    full = make()
    reference = rows(full, 40)
    for k in (0, 1, 9, 23):
        a = make()
        rows(a, k)
        state = json.loads(json.dumps(a.state_dict()))
        b = make()
        b.load_state_dict(state)
        assert rows(b, 40 - k) == reference[3 * k :]
    other = InterleavedLoader([source(1, 7), source(2, 11)], [2.0, 1.0], batch_size=3, seed=5)
    with pytest.raises(ValueError, match="resuming would not reproduce"):
        other.load_state_dict(make().state_dict())


def test_ranks_draw_the_same_sources_and_disjoint_rows() -> None:
    per_rank = []
    for r in range(2):
        mix = InterleavedLoader(
            [source(1, 30, dp_rank=r, dp_world=2), source(2, 50, dp_rank=r, dp_world=2)],
            [1.0, 2.0],
            batch_size=4,
            seed=1,
        )
        per_rank.append(rows(mix, 5))
    assert [t for t, _ in per_rank[0]] == [t for t, _ in per_rank[1]]
    assert not set(per_rank[0]) & set(per_rank[1])


def test_iter_epoch_does_not_move_the_loader() -> None:
    mix = InterleavedLoader(
        [source(1, 9), source(2, 9)], [1.0, 1.0], batch_size=2, seed=0, shuffle=False
    )
    first = [b.input_ids for b in mix.iter_epoch(max_batches=3)]
    second = [b.input_ids for b in mix.iter_epoch(max_batches=3)]
    assert len(first) == 3 and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert torch.equal(next(mix).input_ids, first[0])
    assert len(list(mix.iter_epoch())) <= 9  # an epoch ends when a source runs out


def test_interleaved_build_and_config(tmp_path: Path) -> None:
    chat = tmp_path / "chat.jsonl"
    with open(chat, "w") as f:
        for i in range(60):
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"Say {i} twice."},
                            {"role": "assistant", "content": f"{i} {i}"},
                        ]
                    }
                )
                + "\n"
            )
    cfg = DataConfig(
        dataset="interleave",
        format="chat",
        vocab_size=300,
        num_problems=200,
        cache_dir=str(tmp_path / "cache"),
        sources=(
            SourceConfig(dataset="jsonl", path=str(chat), weight=1.0),
            SourceConfig(dataset="arithmetic", path="add:1-2", weight=3.0),
        ),
    )
    data = build_data(cfg, seq_len=64, batch_size=4, seed=0, log=lambda _: None)
    assert isinstance(data.train, InterleavedLoader) and isinstance(data.val, InterleavedLoader)
    text = data.tokenizer.decode(next(data.train).input_ids.flatten().tolist())
    assert "What is" in text or "twice" in text

    # On the command line the sources are JSON; errors name the key.
    base = get_config("debug")
    spec = json.dumps(
        [
            {"dataset": "jsonl", "path": str(chat), "weight": 2},
            {"dataset": "arithmetic", "path": "sub"},
        ]
    )
    over = apply_overrides(
        base, ["--data.dataset", "interleave", "--data.format", "chat", "--data.sources", spec]
    )
    assert [s.weight for s in over.data.sources] == [2, 1.0]
    assert to_dict(over)["data"]["sources"][1] == {
        "dataset": "arithmetic",
        "path": "sub",
        "field": "",
        "weight": 1.0,
    }
    again = apply_overrides(over, ["--training.steps", "3"])  # rebuilt from asdict's dicts
    assert again.data.sources == over.data.sources
    assert "--data.sources JSON" in help_text(over, "debug")
    for bad, message in [
        ('[{"dataset": "jsonl", "paht": "x"}]', "unknown key(s) ['paht']"),
        ("[1, 2]", "expected a JSON list of objects"),
        ("{oops", "expected a JSON list of objects"),
        ('[{"dataset": "csv", "path": "x"}]', "sources[0].dataset must be one of"),
        ('[{"dataset": "jsonl", "path": "x", "weight": 0}]', "sources[0].weight must be positive"),
        ('[{"dataset": "arithmetic", "path": "div"}]', "unknown arithmetic form 'div'"),
    ]:
        with pytest.raises(ValueError) as e:
            apply_overrides(over, ["--data.sources", bad])
        assert message in str(e.value)
    with pytest.raises(ValueError, match="at least one source"):
        DataConfig(dataset="interleave")
    with pytest.warns(UserWarning, match="sources is ignored"):
        DataConfig(sources=(SourceConfig(dataset="jsonl", path="x"),))
