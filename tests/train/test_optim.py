import pytest

from tidal.train.config import SchedulerConfig
from tidal.train.optim import wsd_multiplier


def test_warmup_stable_decay_shape():
    cfg = SchedulerConfig(warmup_steps=10, decay_fraction=0.2, decay_type="linear")
    lrs = [wsd_multiplier(s, 100, cfg) for s in range(1, 101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(x == 1.0 for x in lrs[10:80])
    assert lrs[-1] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(lrs[80:], lrs[81:], strict=False))


@pytest.mark.parametrize("kind", ["linear", "cosine", "sqrt"])
def test_decay_ends_at_min_ratio(kind):
    cfg = SchedulerConfig(warmup_steps=0, decay_fraction=0.5, decay_type=kind, min_lr_ratio=0.1)
    assert wsd_multiplier(1, 10, cfg) == 1.0
    assert wsd_multiplier(10, 10, cfg) == pytest.approx(0.1)
    mid = wsd_multiplier(8, 10, cfg)
    assert 0.1 < mid < 1.0
