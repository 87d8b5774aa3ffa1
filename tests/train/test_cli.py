"""The front door as a new user meets it: errors first, one clear line and exit status 2,
before any data is encoded or model built; progress and output paths; `--config
MODULE:FUNCTION`; named configs described."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers

from tidal import cli
from tidal.cli import main
from tidal.train.configs import CONFIGS

NO_DATA = ["--data.dataset", "jsonl", "--data.path", "/no/such/data.jsonl"]


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = main(["train", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error(err: str, expected: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("tidal train: error: "), err
    assert expected in lines[0], lines[0]


def test_bad_nproc_and_layouts_fail_before_any_rank_starts(capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "launch_train", lambda *a: pytest.fail("launched torchrun"))
    rc, _, err = run(["--nproc", "0"], capsys)
    assert rc == 2
    one_error(err, "--nproc must be at least 1, got 0")
    rc, _, err = run(["--nproc", "2", "--parallelism.tp", "3"], capsys)
    assert rc == 2
    one_error(err, "world size 2 is not divisible by dp_replicate * cp * tp * pp")


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_checks_that_come_before_any_data(tmp_path: Path, capsys, monkeypatch, nproc) -> None:
    monkeypatch.setattr(cli, "launch_train", lambda *a: pytest.fail("launched torchrun"))
    (tmp_path / "a_file").write_text("")
    out = ["--job.output_dir", str(tmp_path / "out"), "--nproc", nproc, *NO_DATA]
    cases = [
        (["--job.output_dir", str(tmp_path / "a_file")], "is a file; it must be a directory"),
        (["--job.output_dir", str(tmp_path / "a_file" / "x")], "cannot be created"),
        (["--model.attention", "flex", "--job.device", "cpu"], "flex needs a CUDA device"),
        (["--model.vocab_size", "300"], "set --model.vocab_size 4096 or a smaller --data.vocab"),
    ]
    for extra, expected in cases:
        rc, _, err = run([*out, *extra], capsys)
        assert rc == 2
        one_error(err, expected)  # not the missing data file: that would come later


def test_a_tokenizer_file_larger_than_the_model_is_caught_first(tmp_path: Path, capsys) -> None:
    t = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"w{i}": i for i in range(600)}, unk_token="w0")
    )
    t.add_special_tokens(["<|eos|>"])
    t.save(str(tmp_path / "tokenizer.json"))
    rc, _, err = run(
        [
            "--job.output_dir",
            str(tmp_path / "out"),
            "--model.vocab_size",
            "512",
            "--data.tokenizer",
            str(tmp_path / "tokenizer.json"),
            *NO_DATA,
        ],
        capsys,
    )
    assert rc == 2
    one_error(err, "tokenizer.json has 601 tokens and does not fit the 512-token embedding")
    assert "--model.vocab_size 601 (the tokenizer file fixes the vocabulary)" in err
    assert "--data.vocab_size" not in err


def chat_file(path: Path, samples: list) -> Path:
    path.write_text("".join(json.dumps({"messages": s}) + "\n" for s in samples))
    return path


def test_bad_chat_input_stops_before_training(tmp_path: Path, capsys) -> None:
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data = chat_file(tmp_path / "c.jsonl", [ok, ok, [{"role": "user", "content": "hm?"}]])
    base = [
        "--job.output_dir",
        str(tmp_path / "out"),
        "--data.cache_dir",
        str(tmp_path / "c"),
        "--data.dataset",
        "jsonl",
        "--data.format",
        "chat",
        "--data.path",
        str(data),
        "--data.vocab_size",
        "300",
        "--model.vocab_size",
        "300",
    ]
    rc, out, err = run(base, capsys)
    assert rc == 2 and "step" not in out
    one_error(err, "c.jsonl:3: the sample has no assistant turn (roles ['user'])")
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content | nope }}{% endfor %}")
    rc, out, err = run([*base, "--data.chat_template", str(tmp_path / "t.jinja")], capsys)
    assert rc == 2
    one_error(err, "t.jinja does not compile")
    (tmp_path / "t.jinja").write_text("{{ messages[0].nope() }}")
    rc, out, err = run([*base, "--data.chat_template", str(tmp_path / "t.jinja")], capsys)
    assert rc == 2
    one_error(err, "t.jinja cannot render a probe conversation")


def test_config_from_a_module_or_a_file(tmp_path: Path, capsys, monkeypatch) -> None:
    (tmp_path / "my_configs.py").write_text(
        "from tidal.train.configs import debug, register\n\n"
        "@register\n"
        "def debug_long():\n"
        '    """The debug run, ten times longer."""\n'
        "    cfg = debug()\n"
        "    cfg.training.steps = 2400\n"
        "    return cfg\n\n"
        "def not_a_config():\n"
        "    return 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("my_configs:debug_long", f"{tmp_path / 'my_configs.py'}:debug_long"):
        rc, out, _ = run(["--config", spec, "--print-config", "--training.seed", "4"], capsys)
        assert rc == 0
        printed = json.loads(out)
        assert printed["training"]["steps"] == 2400 and printed["training"]["seed"] == 4
    assert "debug_long" in CONFIGS  # importing it registered it
    for spec, expected in [
        ("my_configs:nope", "has no function 'nope'; it has ['debug', 'debug_long'"),
        ("my_configs:not_a_config", "not_a_config() returned int, expected a Config"),
        ("no_such_module_xyz:fn", "cannot import 'no_such_module_xyz'"),
        (f"{tmp_path / 'missing.py'}:fn", "no file"),
    ]:
        rc, _, err = run(["--config", spec, "--print-config"], capsys)
        assert rc == 2
        one_error(err, expected)


def test_every_named_config_has_a_description(capsys) -> None:
    """`tidal configs` lists the training configs, then the RL configs, each list under its
    label, each config with its description."""
    from tidal.rl.configs import RL_CONFIGS

    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    train, _, rl = out.partition("\n\n")
    for block, title, configs in [
        (train, "training configs (tidal train --config NAME):", CONFIGS),
        (rl, "RL configs (tidal rl --config NAME):", RL_CONFIGS),
    ]:
        head, *lines = block.splitlines()
        assert head == title
        assert [line.split()[0] for line in lines] == sorted(configs)
        for line in lines:
            name, _, doc = line.strip().partition(" ")
            assert doc.strip(), f"config {name} has no docstring"


def test_a_run_says_what_it_does_and_where_it_wrote(
    tmp_path: Path, capsys, text_corpus, cache_dir
) -> None:
    out = tmp_path / "out"
    rc, stdout, _ = run(
        [
            "--job.output_dir",
            str(out),
            "--model.flavor",
            "tiny",
            "--model.vocab_size",
            "512",
            "--data.dataset",
            "jsonl",
            "--data.path",
            str(text_corpus),
            "--data.vocab_size",
            "512",
            "--data.cache_dir",
            str(cache_dir),
            "--training.steps",
            "4",
            "--training.batch_size",
            "2",
            "--training.seq_len",
            "32",
            "--metrics.log_every",
            "2",
            "--metrics.val_every",
            "0",
            "--sample.max_new_tokens",
            "4",
        ],
        capsys,
    )
    assert rc == 0
    assert f"training: 4 steps of 64 tokens, a line every 2 steps, metrics to {out}" in stdout
    assert "step 1 took" in stdout
    assert stdout.index("step 1 took") < stdout.index("step      2/4")
    assert stdout.rstrip().endswith(f"wrote {out / 'metrics.jsonl'} and {out / 'sample.txt'}")


def test_launched_ranks_report_one_error_once(tmp_path: Path) -> None:
    # Two real ranks: a warning and an error each would print twice; they print once, no
    # traceback, exit status 2. (The Shakespeare corpus is missing from this cache dir.)
    cmd = [
        sys.executable,
        "-m",
        "tidal",
        "train",
        "--nproc",
        "2",
        "--job.device",
        "cpu",
        "--job.output_dir",
        str(tmp_path / "out"),
        "--data.cache_dir",
        str(tmp_path),
        "--data.path",
        "ignored.txt",
    ]
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    import os

    env.update(
        {
            k: os.environ[k]
            for k in ("HOME", "PYTHONPATH", "VIRTUAL_ENV", "TIDAL_CACHE_DIR")
            if k in os.environ
        }
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("tidal train: error:")]
    assert len(errors) == 1 and "tidal fetch shakespeare" in errors[0]
    assert proc.stderr.count("path='ignored.txt' is ignored") == 1


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_an_interrupt_in_set_up_is_reported_once_per_job(monkeypatch, capsys, rank, printed):
    """A Ctrl-C reaches every rank of a `--nproc` job; only rank 0 says so. Here it comes
    while the config is built."""

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr("tidal.train.configs.get_config", interrupted)
    monkeypatch.setenv("RANK", rank)
    assert main(["train"]) == 130
    assert ("tidal train: interrupted" in capsys.readouterr().err) == printed


@pytest.mark.parametrize(
    "argv", [["models"], ["train", "--help"], ["rl", "--help"]], ids=["models", "train", "rl"]
)
def test_a_reader_that_goes_away_ends_the_command_quietly(argv: list[str]) -> None:
    """`tidal models | head`: the reader closes the pipe before the output ends. The command
    stops with status 141 (128 + SIGPIPE, as other tools) and no traceback. The read end is
    closed before the command writes anything, so every write meets a closed pipe."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert err == "", err


def test_an_interrupt_inside_a_string_exec_still_exits_130(tmp_path: Path) -> None:
    """A Ctrl-C often lands in a lazy import, inside the `exec` of source text that
    `dataclasses` runs to build a class's methods. CPython (3.8-3.14) then marks the
    KeyboardInterrupt unhandled even once tidal has caught it, and a `python -m` run (as
    torchrun starts ranks) would end killed by SIGINT instead of with 130. A config file whose
    function is interrupted in such an `exec` plays that Ctrl-C, deterministically."""
    config = tmp_path / "interrupted_config.py"
    config.write_text('def config():\n    exec("raise KeyboardInterrupt", {})\n')
    proc = subprocess.run(
        [sys.executable, "-m", "tidal", "train", "--config", f"{config}:config"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "tidal train: interrupted\n", proc.stderr
