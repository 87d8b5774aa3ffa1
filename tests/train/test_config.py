"""Config system: overrides, validation errors, help text, the CLI front end."""

import json

import pytest

from tidal.cli import main
from tidal.train.config import TrainingConfig
from tidal.train.config_parse import apply_overrides, field_docs, help_text, to_dict
from tidal.train.configs import CONFIGS, get_config


def test_every_field_is_documented():
    cfg = get_config("debug")
    for section in to_dict(cfg):
        cls = type(getattr(cfg, section))
        docs = field_docs(cls)
        missing = [f for f in cls.__dataclass_fields__ if not docs.get(f)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_all_named_configs_build():
    for name in CONFIGS:
        assert get_config(name).model.flavor


def test_overrides_are_typed_and_validated():
    cfg = apply_overrides(
        get_config("debug"),
        [
            "--training.steps",
            "7",
            "--training.compile=true",
            "--model.vocab_size",
            "none",
            "--optimizer.lr",
            "1e-3",
            "--lr_scheduler.decay_type",
            "sqrt",
        ],
    )
    assert cfg.training.steps == 7 and cfg.training.compile is True
    assert cfg.model.vocab_size is None and cfg.optimizer.lr == 1e-3
    assert cfg.lr_scheduler.decay_type == "sqrt"
    assert get_config("debug").training.steps != 7  # named configs are rebuilt, not shared


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.stepz", "1"], "unknown field --training.stepz; training has"),
        (["--trainin.steps", "1"], "unknown config section"),
        (["--training.steps", "ten"], "--training.steps: expected int, got 'ten'"),
        (["--training.steps", "0"], "training.steps must be positive"),
        (["--training.compile", "maybe"], "expected a boolean"),
        (["--model.flavor", "llama9"], "model.flavor 'llama9' is unknown; choose one of"),
        (["--model.attention", "xformers"], "is not one of sdpa, flex"),
        (["--training.seq_len", "4096"], "exceeds the max_seq_len=2048"),
        (["--data.val_fraction", "1.5"], "val_fraction must be in [0, 1)"),
        (["--data.dataset", "jsonl"], "DataConfig.path is required"),
        (["--training.steps"], "needs a value"),
        (["--training.steps", "--training.seed", "1"], "--training.steps needs a value"),
    ],
)
def test_bad_overrides_name_the_field(argv, message):
    with pytest.raises(ValueError, match=None) as e:
        apply_overrides(get_config("debug"), argv)
    assert message in str(e.value)


def test_unknown_config_name():
    with pytest.raises(ValueError, match="unknown config 'nope'; choose one of"):
        get_config("nope")


def test_dataclass_validation_directly():
    with pytest.raises(ValueError, match="training.batch_size must be positive"):
        TrainingConfig(batch_size=0)


def test_help_lists_every_field_with_doc():
    text = help_text(get_config("debug"), "debug")
    assert "--training.steps INT" in text and "Optimizer steps to run." in text
    assert "--model.attention {sdpa,flex}" in text
    assert "--job.output_dir STR" in text


def test_cli_print_config_and_help(capsys):
    assert main(["train", "--config", "debug", "--print-config", "--training.seed", "3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["training"]["seed"] == 3 and printed["job"]["output_dir"] == "outputs/debug"
    assert main(["train", "--config", "debug", "--help"]) == 0
    assert "--training.batch_size" in capsys.readouterr().out


def test_cli_errors_exit_2(capsys):
    assert main(["train", "--config", "nope"]) == 2
    assert "unknown config 'nope'" in capsys.readouterr().err
    assert main(["train", "--config", "debug", "--training.steps", "x"]) == 2
    assert main(["frobnicate"]) == 2


def test_cli_lists_models_and_configs(capsys):
    assert main(["models"]) == 0
    assert "llama3_8b" in capsys.readouterr().out
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    assert "debug" in out
    # A description spread over lines is printed to the end of its first sentence.
    assert (
        "a sloppy teacher, who forgets 55% of the carries (and answers what it worked out)." in out
    )


def test_a_bare_boolean_flag_means_true():
    cfg = apply_overrides(
        get_config("debug"),
        ["--checkpoint.enable", "--checkpoint.interval", "50", "--training.compile"],
    )
    assert cfg.checkpoint.enable and cfg.checkpoint.interval == 50 and cfg.training.compile
