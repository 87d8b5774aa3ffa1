"""Options of the sync RL loop exercised through `tidal rl` itself (launcher, embedded store,
generator processes, the trainer's ranks): the policy from a Hugging Face folder and from a
checkpoint, the KL term's frozen reference (1 and 2 FSDP ranks), truncated importance
sampling, two generators, the trainer under tensor and pipeline parallelism (2 CPU ranks,
gloo), and a policy publish that fails.

The config is tests/rl/loop_configs.py:tiny, launched as in test_loop.py (tests/rl/_cli.py).
The real SmolLM2-135M-Instruct folder runs in a `slow` test when it has been fetched."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import USER_CACHE_DIR
from tests.rl._cli import NO_PLOT, records, run_rl
from tests.rl.loop_configs import tiny
from tidal.models import Transformer, get_flavor, load_hf, save_hf
from tidal.train.checkpoint.hf import read_model
from tidal.train.data.chat import BUILTIN_TEMPLATE


def _model(seed: int) -> Transformer:
    with torch.device("meta"):
        model = Transformer(get_flavor("tiny", vocab_size=512))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """The loop config's model (the tiny flavor, vocabulary 512) as save_hf writes it, seeded
    apart from the loop's seed init, with the config's BPE tokenizer and a chat template in
    tokenizer_config.json."""
    from tidal.rl.warmstart import policy_tokenizer

    folder = tmp_path_factory.mktemp("hf") / "model"
    save_hf(_model(seed=3), folder)
    policy_tokenizer("sft:sft_addition", tiny()).save(folder / "tokenizer.json")
    config = {"chat_template": BUILTIN_TEMPLATE, "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _weights(run: Path) -> dict[str, torch.Tensor]:
    """The model state dict of a run's newest checkpoint."""
    return read_model(run / "checkpoint", log=lambda line: None, progress=False)[1]


def _assert_near(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Equal up to one optimizer step at lr 1e-7 (Adam moves each weight by about lr)."""
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0, msg=k)


def test_the_policy_starts_from_a_hugging_face_folder_and_from_a_checkpoint(tmp_path, hf_folder):
    """policy.init=hf:FOLDER: the trainer starts from the folder's weights (its step-1
    checkpoint at lr 1e-7 holds them, not the seed init) with the folder's tokenizer and chat
    template; then policy.init=checkpoint:PATH of that run starts another run from there."""
    from tidal.rl.warmstart import resolve_policy
    from tidal.train.config_parse import apply_overrides

    hf = ["--policy.init", f"hf:{hf_folder}", "--policy.tokenizer", ""]
    src = resolve_policy(apply_overrides(tiny(), hf), log=lambda line: None)
    assert src.encoder.template.name == str(hf_folder / "tokenizer_config.json")
    assert src.hf_folder == hf_folder

    one_step = ("--rl.steps", "1", "--optimizer.lr", "1e-7", "--checkpoint.enable", "true")
    first = tmp_path / "from_hf"
    r = run_rl(first, *hf, *one_step, *NO_PLOT)
    assert r.returncode == 0, r.stdout
    assert f"trainer: Hugging Face folder {hf_folder}" in r.stdout
    steps, evals = records(first)
    assert len(steps) == 1 and [e["step"] for e in evals] == [0, 1]
    from_hf = _weights(first)
    _assert_near(from_hf, load_hf(hf_folder).state_dict())
    seed = _model(seed=0).state_dict()  # the loop config's own seed init is far from it
    assert not torch.allclose(from_hf["output.weight"], seed["output.weight"], atol=1e-3)

    second = tmp_path / "from_checkpoint"
    r = run_rl(
        second,
        "--policy.init",
        f"checkpoint:{first / 'checkpoint'}",
        "--policy.tokenizer",
        str(hf_folder / "tokenizer.json"),
        *one_step,
        *NO_PLOT,
    )
    assert r.returncode == 0, r.stdout
    assert f"trainer: checkpoint {first / 'checkpoint' / 'step-1'}" in r.stdout
    _assert_near(_weights(second), from_hf)


def test_a_hugging_face_folder_without_a_tokenizer_fails_before_any_role_starts(
    tmp_path, hf_folder
):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(hf_folder / name)
    r = run_rl(
        tmp_path / "run",
        "--policy.init",
        f"hf:{bare}",
        "--policy.tokenizer",
        "",
        timeout=60,
    )
    assert r.returncode == 2, r.stdout
    assert f"tidal rl: error: policy.init: no tokenizer.json in {bare}" in r.stdout
    assert "trainer:" not in r.stdout and "generator 0: on" not in r.stdout


SMOLLM2 = USER_CACHE_DIR / "models" / "smollm2-135m"


@pytest.mark.slow
@pytest.mark.skipif(
    not (SMOLLM2 / "config.json").is_file(),
    reason=f"SmolLM2-135M-Instruct is not fetched ({SMOLLM2}): run `tidal fetch smollm2-135m` once",
)
def test_rl_addition_from_smollm2(tmp_path):
    """The issue's example: `tidal rl --config rl_addition --policy.init hf:<SmolLM2 folder>`
    on CPU, at small sizes (two steps of 2 prompts x 4 samples, 24 new tokens)."""
    out = tmp_path / "run"
    r = run_rl(
        out,
        "--policy.init",
        f"hf:{SMOLLM2}",
        "--rl.steps",
        "2",
        "--rl.eval_every",
        "0",
        "--rollout.prompts_per_step",
        "2",
        "--rollout.group_size",
        "4",
        "--rollout.max_new_tokens",
        "24",
        "--task.eval_problems",
        "4",
        "--trainer.micro_batch_size",
        "8",
        "--generator.max_batch",
        "8",
        "--checkpoint.enable",
        "false",
        *NO_PLOT,
        config="rl_addition",
        timeout=600,
    )
    assert r.returncode == 0, r.stdout
    assert "134.5M parameters, vocab 49152" in r.stdout
    assert f"checkpoint: loaded {SMOLLM2}" in r.stdout  # the folder's weights, not a seed init
    steps, evals = records(out)
    assert [s["step"] for s in steps] == [1, 2]
    assert [e["step"] for e in evals] == [0, 2] and all(e["eval_total"] == 4 for e in evals)
    assert all(s["response_len_mean"] > 0 for s in steps)


def test_kl_to_the_frozen_reference(tmp_path):
    """loss.kl_coef > 0: the trainer scores each batch under a frozen copy of its starting
    weights. The k3 KL is 0 at step 1 (the policy is the reference) and positive once a step
    has moved the weights. Batch-invariant, one trainer rank and two (FSDP) make the same
    run: the swap to the reference and back also reaches FSDP's gathered parameters (it did
    not: with two ranks the KL pass read the policy's root weights and the step trained on
    the reference's, KL 0.09 instead of 0.17 at step 2)."""
    runs = []
    for nproc in (1, 2):
        out = tmp_path / f"run{nproc}"
        r = run_rl(
            out,
            "--rl.steps",
            "3",
            "--loss.kl_coef",
            "0.1",
            "--generator.batch_invariant",
            "true",
            "--nproc",
            str(nproc),
            *NO_PLOT,
        )
        assert r.returncode == 0, r.stdout
        steps, _ = records(out)
        kl = [s["kl"] for s in steps]
        assert len(kl) == 3 and all(math.isfinite(x) for x in kl), kl
        assert abs(kl[0]) < 1e-6 and all(x > 0 for x in kl[1:]), kl
        assert all(s["ratio_min"] == 1.0 and s["ratio_max"] == 1.0 for s in steps), steps
        runs.append(steps)
    assert " kl 0.0000 " in r.stdout
    one, two = runs
    assert [s["reward_mean"] for s in one] == [s["reward_mean"] for s in two]
    assert [s["kl"] for s in two] == pytest.approx([s["kl"] for s in one], rel=1e-4, abs=1e-6)


def test_truncated_importance_sampling(tmp_path):
    """loss.tis_cap: the trainer recomputes the old log-probs itself and weights tokens by
    min(pi_old / pi_gen, cap). In batch-invariant mode its recomputation equals the
    generator's log-probs bitwise, so every weight is exactly 1 and none is capped."""
    out = tmp_path / "run"
    r = run_rl(
        out,
        "--rl.steps",
        "2",
        "--loss.tis_cap",
        "2.0",
        "--generator.batch_invariant",
        "true",
        *NO_PLOT,
    )
    assert r.returncode == 0, r.stdout
    steps, _ = records(out)
    assert len(steps) == 2
    for s in steps:
        assert s["tis_weight_mean"] == 1.0 and s["tis_capped_frac"] == 0.0, s
        assert s["ratio_min"] == 1.0 and s["ratio_max"] == 1.0, s


def test_two_generators_each_contribute_every_step(tmp_path):
    """generator.count 2: each generator samples its share of the prompts (2 of 4) and the
    trainer trains on both shares: 4 groups of 8 samples a step."""
    out = tmp_path / "run"
    r = run_rl(
        out,
        "--rl.steps",
        "2",
        "--generator.count",
        "2",
        *NO_PLOT,
    )
    assert r.returncode == 0, r.stdout
    assert "generator 0: on cpu" in r.stdout and "generator 1: on cpu" in r.stdout
    assert "2 prompts a step" in r.stdout
    steps, evals = records(out)
    assert len(steps) == 2 and len(evals) == 2
    for s in steps:
        assert s["groups"] == 4 and s["samples"] == 32, s
        assert s["samples_per_generator"] == [16, 16], s


@pytest.mark.parametrize(
    "layout, args",
    [
        ("tp=2", ["--parallelism.tp", "2"]),
        ("pp=2", ["--parallelism.pp", "2", "--parallelism.pp_microbatches", "2"]),
    ],
    ids=["tp2", "pp2"],
)
def test_the_trainer_on_two_ranks_in_another_layout(tmp_path, hf_folder, layout, args):
    """The trainer as 2 ranks (gloo) under tensor or pipeline parallelism, from the Hugging
    Face folder (each rank loads its shards or stage): the generator reads
    every version from the store into its own unsharded model, and the trainer recomputes
    the generator's log-probs to fp32 rounding (ratios 1 up to 1e-4). tokens_per_s_train
    counts real token positions only: under pipeline parallel every sequence is padded to
    the fixed 32 + 8 positions, 32 x 40 a step, of which train_pad_frac is padding."""
    out = tmp_path / "run"
    r = run_rl(
        out,
        "--rl.steps",
        "3",
        "--nproc",
        "2",
        "--parallelism.dp_shard",
        "1",
        *args,
        "--policy.init",
        f"hf:{hf_folder}",
        "--policy.tokenizer",
        "",
        *NO_PLOT,
    )
    assert r.returncode == 0, r.stdout
    assert f"world 2 ({layout})" in r.stdout
    assert f"checkpoint: loaded {hf_folder}" in r.stdout
    steps, _ = records(out)
    assert len(steps) == 3
    for s in steps:
        assert abs(s["ratio_min"] - 1) < 1e-4 and abs(s["ratio_max"] - 1) < 1e-4, s
        real = s["tokens_per_s_train"] * s["train_s"]
        assert real >= s["samples"] * s["response_len_mean"]  # the completions at least
        if layout == "pp=2":
            assert real / (1 - s["train_pad_frac"]) == pytest.approx(32 * 40, rel=1e-6)
            assert real < 32 * 40
    assert steps[-1]["reward_mean"] != steps[0]["reward_mean"]  # the policy did change


def test_a_failed_publish_stops_every_role_at_once(tmp_path):
    """The trainer reads a publish's result only after the next rollouts, which no generator
    can make without that version: a publish that fails stops every role at once, naming
    the error, instead of each waiting out rl.wait_timeout_s (60 s here) for the other."""
    start = time.monotonic()
    r = run_rl(
        tmp_path / "run",
        "--rl.steps",
        "4",
        *NO_PLOT,
        config="tests/rl/loop_configs.py:publish_fails",
    )
    took = time.monotonic() - start
    assert r.returncode != 0, r.stdout
    why = "failed to publish policy version 2: RuntimeError: publish failure on purpose"
    assert why in r.stdout
    assert "generator 0: waited" not in r.stdout
    assert took < 45, took


def test_the_warm_start_cache_key_ignores_tools_but_not_float8():
    """Profiler, debug and checkpoint-saving settings never change the trained weights: the
    SFT warm start's cache folder stays; float8, an initial load or any training setting
    moves it."""
    from tidal.rl.configs import get_rl_config
    from tidal.rl.warmstart import sft_run

    def folder(overrides: str):
        cfg = get_rl_config("rl_addition")
        cfg.policy.sft_overrides = overrides
        return sft_run(cfg)[1]

    plain = folder("")
    assert folder("profiler.enable=true debug.flight_recorder=false metrics.wandb=true") == plain
    assert folder("checkpoint.enable=true checkpoint.interval=50") == plain  # saves only
    assert folder("checkpoint.enable=true checkpoint.initial_load_path=elsewhere") != plain
    assert folder("quantize.float8=tensorwise") != plain
    assert folder("training.steps=301") != plain
