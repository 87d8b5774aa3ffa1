"""Routing replay (R3) on a tiny mixture-of-experts policy, CPU fp32, batch-invariant mode.

The generator's model selects its experts with a stale expert bias (as a generator that has
not received the trainer's latest aux-loss-free bias would): the bias moves the choice of
experts, not the weights, so without replay the trainer's log-probs differ from the
generator's, the gap the step reports as `logprob_diff_max` / `logprob_diff_mean`; with
replay the trainer routes every token to the generator's experts, its log-probs are the
generator's bit for bit and every PPO ratio is exactly 1.0. The records travel through the
store with the rollout. Bad input: a dense model, records of another shape."""

import pytest
import torch

import tidal.store
from tests.rl._trainer import no_data, rl_config
from tidal.generate import Generator, GeneratorConfig, SamplingParams
from tidal.models import Transformer
from tidal.models.moe import moe_layers, replay_routing
from tidal.rl.loss import LossConfig, group_advantages
from tidal.rl.rollout import RolloutBatch
from tidal.rl.tasks.base import Grade
from tidal.rl.trainer_inputs import (
    PolicyLoss,
    check_routed_experts,
    rollout_batches,
    train_on_rollout,
)
from tidal.train.trainer import Trainer

PROMPTS = [[0, 5, 7, 9], list(range(2, 20)), [0, 4]]


def moe_trainer(out, device: str = "cpu", seq_len: int = 48) -> Trainer:
    """The fp32 `debug_moe` trainer in batch-invariant mode (vocabulary 512)."""
    cfg = rl_config(
        out,
        "--model.flavor",
        "debug_moe",
        "--training.batch_invariant",
        "true",
        "--training.seq_len",
        str(seq_len),
        "--job.device",
        device,
    )
    return Trainer(cfg, data=no_data(), log=lambda *a: None)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    t = moe_trainer(tmp_path_factory.mktemp("replay"))
    yield t
    t.close()


def stale_generator(
    trainer: Trainer, tokenizer=None, max_batch: int = 4, max_seq_len: int = 48
) -> Generator:
    """A generator on a copy of the trainer's weights whose MoE layers select with a bias the
    trainer does not have (the weights are the same probabilities: only the choice moves)."""
    model = Transformer(trainer.args).to(trainer.device)
    model.load_state_dict(trainer.model.state_dict())
    g = torch.Generator().manual_seed(0)
    for m in moe_layers(model):
        m.expert_bias = (torch.randn(m.args.n_experts, generator=g) * 0.02).to(trainer.device)
    cfg = GeneratorConfig(
        max_batch=max_batch,
        max_seq_len=max_seq_len,
        check_every=4,
        batch_invariant=True,
        record_routing=True,
    )
    return Generator(model, tokenizer=tokenizer, config=cfg)


def rollout_of(gen: Generator) -> RolloutBatch:
    params = [
        SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=i) for i in range(len(PROMPTS))
    ]
    samples = [s for g in gen.generate(PROMPTS, params) for s in g]
    grades = [Grade(reward=float(i % 2), answer=None, format_ok=True) for i in range(len(samples))]
    batch = RolloutBatch.from_samples(samples, grades, task="test")
    with tidal.store.connect() as store:  # the generator -> trainer path
        store.put_state_dict(batch.to_state_dict(), "rollouts", version=0)
        return RolloutBatch.from_state_dict(store.get_state_dict("rollouts", version=0))


def test_replay_makes_the_trainers_logprobs_the_generators_bits(trainer):
    check_replay_is_bitwise(trainer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replay_is_bitwise_on_cuda(tmp_path):
    """The same in fp32 on a GPU: the generator's MoE experts take their loop (batch-invariant
    mode), so its decode steps run without CUDA graphs."""
    trainer = moe_trainer(tmp_path, "cuda")
    try:
        check_replay_is_bitwise(trainer)
    finally:
        trainer.close()


def check_replay_is_bitwise(trainer: Trainer) -> None:
    gen = stale_generator(trainer)
    assert not gen.captures
    check_rollout_replays(trainer, rollout_of(gen))


def check_rollout_replays(trainer: Trainer, rollout: RolloutBatch) -> None:
    """Without replay the trainer's log-probs differ from the generator's, with it they are
    the same bits: in `Trainer.logprobs` and in the training step (weights restored)."""
    assert rollout.prompt_experts is not None and rollout.prompt_experts.dtype == torch.uint8
    assert rollout.completion_experts is not None
    cfg = LossConfig(drop_equal_groups=False)
    adv = group_advantages(rollout.rewards, rollout.group_ids, cfg)

    def gaps(replay: bool) -> list[torch.Tensor]:
        batches = rollout_batches(rollout, adv, micro_batch_size=4, routing_replay=replay)
        out = []
        for b in batches:
            lp, mask = trainer.logprobs(b), b.extras["mask"]
            out.append((lp[mask] - b.extras["gen_logprobs"][mask]).abs())
        return out

    without, with_ = torch.cat(gaps(False)), torch.cat(gaps(True))
    assert float(without.max()) > 1e-3  # the stale bias routed some tokens elsewhere
    assert float(with_.max()) == 0.0  # bit for bit

    # The training step: ratios exactly one, the gap reported as zero; without replay it
    # reports the gap it measured.
    weights = [p.detach().clone() for p in trainer.params]
    try:
        m, _, _ = train_on_rollout(trainer, rollout, adv, PolicyLoss(cfg), micro_batch_size=4)
        assert m["logprob_diff_max"] == pytest.approx(float(without.max()), rel=1e-6)
        assert m["logprob_diff_mean"] == pytest.approx(float(without.mean()), rel=1e-4)
        assert m["ratio_max"] > 1.0 or m["ratio_min"] < 1.0
        with torch.no_grad():
            for p, w in zip(trainer.params, weights, strict=True):
                p.copy_(w)
        replayed = LossConfig(drop_equal_groups=False, routing_replay=True)
        m, _, _ = train_on_rollout(trainer, rollout, adv, PolicyLoss(replayed), micro_batch_size=4)
        assert m["ratio_max"] == 1.0 and m["ratio_min"] == 1.0 and m["clip_frac"] == 0.0
        assert m["logprob_diff_max"] == 0.0 and m["logprob_diff_mean"] == 0.0
        assert m["moe_load_max"] >= 1.0
    finally:
        with torch.no_grad():
            for p, w in zip(trainer.params, weights, strict=True):
                p.copy_(w)


def test_replay_trains_the_router_with_the_trainers_weights(trainer):
    """Under replay the gate weights are the trainer's router probabilities at the replayed
    experts: the router gets a gradient, and other router weights give other outputs."""
    model = trainer.model
    ids = torch.tensor([PROMPTS[1]])
    L, K = len(moe_layers(model)), moe_layers(model)[0].args.top_k
    experts = torch.stack([torch.arange(K).roll(t % K) for t in range(ids.shape[1])])
    experts = experts.expand(1, L, -1, -1).to(torch.uint8)
    with replay_routing(model, experts):
        out = model(ids).float().sum()
    got = torch.stack([m.last_experts_NK for m in moe_layers(model)])
    assert torch.equal(got, experts[0].long())
    out.backward()
    router = moe_layers(model)[0].router.weight
    assert router.grad is not None and float(router.grad.abs().sum()) > 0
    model.zero_grad(set_to_none=True)
    assert all(m.replay_BTK is None for m in moe_layers(model))  # left as found


def test_bad_input(trainer):
    rollout = rollout_of(stale_generator(trainer))
    L, E, K = 4, 8, 2
    check_routed_experts(rollout, (L, E, K))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model; the policy is dense"):
        check_routed_experts(rollout, None)
    with pytest.raises(
        ValueError, match=r"\[samples, 4 layers, tokens, top_k 2\]; the model has 3"
    ):
        check_routed_experts(rollout, (3, E, K))
    with pytest.raises(ValueError, match="name expert 7; the model has 4"):
        check_routed_experts(rollout, (L, 4, K))
    bare = RolloutBatch.from_state_dict(
        {k: v for k, v in rollout.to_state_dict().items() if "experts" not in k}
    )
    with pytest.raises(ValueError, match="without GeneratorConfig.record_routing"):
        check_routed_experts(bare, (L, E, K))
    with pytest.raises(ValueError, match="do not match the model"):
        with replay_routing(trainer.model, torch.zeros(1, 3, 5, K, dtype=torch.uint8)):
            pass
    with pytest.raises(ValueError, match="come together"):
        RolloutBatch(**{**_fields(rollout), "completion_experts": None})
    with pytest.raises(ValueError, match="the batch needs"):
        RolloutBatch(**{**_fields(rollout), "prompt_experts": rollout.prompt_experts[:, :, :3]})


def test_dense_policy_is_refused_before_any_work(tmp_path):
    from tidal.models import get_flavor
    from tidal.rl.build import check_routing_replay
    from tidal.rl.configs import get_rl_config
    from tidal.train.config_parse import apply_overrides

    cfg = apply_overrides(get_rl_config("rl_addition"), ["--loss.routing_replay", "true"])
    with pytest.raises(ValueError, match="loss.routing_replay=true .* is dense"):
        check_routing_replay(cfg, get_flavor("debug"))
    check_routing_replay(cfg, get_flavor("debug_moe"))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model; this one is dense"):
        with replay_routing(torch.nn.Linear(2, 2), torch.zeros(1, 1, 1, 1)):
            pass


def _fields(b: RolloutBatch) -> dict:
    import dataclasses

    return {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}


def test_grpo_loop_with_replay_on_a_tiny_moe(tmp_path, cache_dir, capsys):
    """`rl_addition_moe` through the one-process loop, shrunk: with replay in batch-invariant
    mode every step reports no gap and ratios of exactly one; a dense policy is refused with
    one line before anything is built."""
    import json

    from tidal.rl import grpo

    base = [
        "--config", "rl_addition_moe", "--policy.cache_dir", str(cache_dir),
        "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
        "--rollout.max_new_tokens", "6", "--task.eval_problems", "2", "--rl.steps", "2",
        "--job.device", "cpu", "--generator.device", "cpu", "--metrics.plot", "false",
    ]  # fmt: skip
    out = tmp_path / "moe"
    args = ["--job.output_dir", str(out), "--generator.batch_invariant", "true"]
    assert grpo.main([*base, *args, "--loss.routing_replay", "true"]) == 0
    steps = [r for r in map(json.loads, open(out / "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["logprob_diff_max"] == 0.0 and r["logprob_diff_mean"] == 0.0
        assert r["ratio_max"] == 1.0 and r["ratio_min"] == 1.0
        assert r["moe_load_max"] >= 1.0
    dense = ["--model.flavor", "debug", "--loss.routing_replay", "true"]
    capsys.readouterr()
    assert grpo.main([*base, "--job.output_dir", str(tmp_path / "dense"), *dense]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "loss.routing_replay=true replays the experts" in err[0], err
    assert "is dense" in err[0]
