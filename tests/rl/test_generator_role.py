"""The RL generator role's Generator: built from an RL config, warmed up for the variants it
runs (tidal/rl/build.py)."""

import pytest

from tests.generate.conftest import tiny_model
from tidal.generate import Generator, GeneratorConfig


def test_compile_scope_reaches_the_rl_generator_from_the_command_line():
    """`tidal rl ... --generator.compile_scope blocks` builds the role's Generator with it."""
    from tidal.models import get_flavor
    from tidal.rl.build import build_generator
    from tidal.rl.configs import get_rl_config
    from tidal.rl.warmstart import PolicySource
    from tidal.train.config_parse import apply_overrides

    flags = ["--generator.compile_scope", "blocks", "--generator.device", "cpu"]
    cfg = apply_overrides(get_rl_config("rl_addition"), flags)
    src = PolicySource(
        args=get_flavor("tiny", max_seq_len=128),
        flavor="tiny",
        vocab_size=None,
        tokenizer=None,
        encoder=None,
    )  # type: ignore[arg-type]
    with pytest.warns(UserWarning, match="compile_scope='blocks' is ignored"):  # CPU
        gen = build_generator(cfg, src)
    assert gen.config.compile_scope == "blocks"


def test_the_rl_generator_warms_up_the_variants_it_runs(monkeypatch):
    """The RL role warms its rollouts' sampler variant, and greedy where it evaluates
    (generator 0), before it says it is ready; on CPU the warm-up does nothing."""
    from tidal.generate.sampler import variant_of
    from tidal.rl.build import warm_up_generator
    from tidal.rl.configs import get_rl_config
    from tidal.train.config_parse import apply_overrides

    gen = Generator(tiny_model(), config=GeneratorConfig(max_batch=4, max_seq_len=64))
    cfg = apply_overrides(get_rl_config("rl_addition"), ["--rollout.top_p", "0.95"])
    lines: list[str] = []
    warm_up_generator(gen, cfg, 0, log=lines.append)
    assert lines == [] and gen.stats.warmup_seconds == 0  # CPU: nothing compiled or captured
    asked = []
    monkeypatch.setattr(gen, "warm_up", lambda params: asked.append(params) or 1.5)
    for index in (0, 1):
        warm_up_generator(gen, cfg, index, log=lines.append)
    variants = [sorted(variant_of(p) for p in ps) for ps in asked]
    assert variants == [["greedy", "truncated"], ["truncated"]]
    assert lines[0].startswith("generator 0: warmed up in 1.5 s")
