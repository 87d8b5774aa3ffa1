"""The generated arithmetic corpus (worked solutions that check out, disjoint deterministic
splits, the answer format graders parse), the exact-match evaluation, and a short SFT run on it
through the trainer."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from tidal.train.config_parse import apply_overrides
from tidal.train.configs import get_config
from tidal.train.data import arithmetic
from tidal.train.data.arithmetic import generate, make_problem, parse_answer, parse_spec, split_of
from tidal.train.data.chat import build_encoder
from tidal.train.data.config import CHAT_SPECIAL_TOKENS
from tidal.train.data.tokenizer import train_bpe
from tidal.train.evaluate import exact_match, greedy_complete
from tidal.train.loss import IGNORE_INDEX
from tidal.train.trainer import Trainer


def test_the_worked_example_reads_as_documented() -> None:
    p = make_problem("add", 457, 168)
    assert p.prompt == "What is 457 + 168?"
    assert p.solution == (
        "457 + 168: 7 + 8 = 15, carry 1, so far 5\n"
        "45 + 16: 5 + 6 + 1 = 12, carry 1, so far 25\n"
        "4 + 1: 4 + 1 + 1 = 6, so far 625\n"
        "#### 625"
    )
    assert p.messages() == [
        {"role": "user", "content": "What is 457 + 168?"},
        {"role": "assistant", "content": p.solution},
    ]
    assert (
        arithmetic.__doc__ is not None and p.solution.replace("\n", "\n    ") in arithmetic.__doc__
    )
    sub = make_problem("sub", 524, 168).solution.splitlines()
    assert sub[0] == "524 - 168: 14 - 8 = 6, borrow 1, so far 6"
    assert make_problem("mul", 457, 3).solution.endswith(
        "4 * 3: 4 * 3 + 1 = 13, so far 1371\n#### 1371"
    )


@pytest.mark.parametrize("spec", ["add:1-6", "sub:1-6", "mul:1-6"])
def test_every_step_checks_out(spec: str) -> None:
    step = re.compile(
        r"^(\d+) ([-+*]) (\d+): ([\d +*-]+) = (\d+)(?:, (carry|borrow) (\d+))?, so far (\d+)$"
    )
    for p in generate(spec, 300, split="train", seed=1):
        *lines, final = p.solution.splitlines()
        assert final == f"#### {p.answer}" and parse_answer(p.solution) == p.answer
        assert p.answer == {"add": p.a + p.b, "sub": p.a - p.b, "mul": p.a * p.b}[p.form]
        so_far = ""
        for i, line in enumerate(lines):
            m = step.match(line)
            assert m, line
            left_a, left_b = int(m[1]), int(m[3])
            assert left_a == p.a // 10**i  # what is left of the operands
            assert left_b == (p.b if p.form == "mul" else p.b // 10**i)
            total = int(m[5])
            assert eval(m[4]) == total  # the column's own arithmetic
            last = i == len(lines) - 1
            if p.form != "sub":
                assert (m[6] is not None) == (not last and total >= 10)
            written = str(total) if last or p.form == "sub" else str(total % 10)
            assert m[8] == written + so_far  # one more digit in front
            so_far = m[8]
        assert int(so_far) == p.answer


def test_generation_is_deterministic_and_splits_never_overlap() -> None:
    train = generate("add,sub,mul", 3000, split="train", seed=0)
    assert [p.key for p in train[:50]] == [
        p.key for p in generate("add,sub,mul", 50, split="train")
    ]
    assert [p.key for p in generate("add", 50, split="train", seed=1)] != [
        p.key for p in generate("add", 50, split="train", seed=0)
    ]
    val = generate("add,sub,mul", 500, split="val", seed=7)
    assert not {p.key for p in train} & {p.key for p in val}
    assert all(split_of(p.key) == "val" for p in val)
    assert {p.form for p in train} == {"add", "sub", "mul"}
    digits = {len(str(p.a)) for p in train if p.form == "add"}
    assert digits == {1, 2, 3, 4}
    assert parse_spec("add:2-5, mul") == [("add", 2, 5, 0.0), ("mul", 1, 4, 0.0)]
    assert parse_spec("") == [("add", 1, 4, 0.0)]
    assert parse_spec("add:slip=0.5:1-3") == [("add", 1, 3, 0.5)]
    for bad in ("div", "add:5-2", "add:0-3", "add:3", "add:slip=1.5", "add:slip=x", "sub:slip=0.2"):
        with pytest.raises(ValueError, match="DataConfig.path"):
            parse_spec(bad, where="DataConfig.path")
    tiny = generate("add:1-1", 50, split="val")  # 100 problems, a few held out, repeated
    assert all(split_of(p.key) == "val" for p in tiny) and len({p.key for p in tiny}) < 20


def test_add_problems_held_out_are_the_rl_tasks_eval_split() -> None:
    from tidal.rl.tasks import get_task

    task = get_task("addition", digits=(1, 3))
    stream = task.problems("train", seed=3)
    problems = [next(stream) for _ in range(400)] + task.eval_set(100)
    for p in problems:
        a, b = map(int, p.prompt.removeprefix("What is ").removesuffix("?").split(" + "))
        want = "val" if task.split_of(p) == "eval" else "train"
        assert split_of(f"add:{a}:{b}") == split_of(f"add:{b}:{a}") == want


def test_a_slipping_teacher_forgets_carries_and_answers_what_it_worked_out() -> None:
    perfect = generate("add:2-4", 400, split="train")
    sloppy = generate("add:2-4:slip=0.5", 400, split="train")
    carries = [p for p in perfect if ", carry" in p.solution]
    wrong = [p for p in sloppy if p.answer != p.a + p.b]
    assert 0.2 < len(wrong) / len(carries) < 0.8
    for p in wrong:
        assert parse_answer(p.solution) == p.answer
        lines = p.solution.splitlines()
        # Some line after a "carry 1" adds only its two digits.
        assert any(
            "carry 1" in prev and line.split(": ")[1].split(" = ")[0].count("+") == 1
            for prev, line in zip(lines[:-2], lines[1:-1], strict=True)
        )
    assert all(p.answer == p.a + p.b for p in generate("add:2-4:slip=0", 100, split="train"))
    with pytest.raises(ValueError, match="slip"):
        make_problem("add", 5, 7, slip=0.5)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("...\n#### 625", 625),
        ("#### 12\n#### 13", 13),
        ("I think it is 42.", 42),
        ("#### -7", -7),
        ("no number here", None),
    ],
)
def test_parse_answer(text: str, answer: int | None) -> None:
    assert parse_answer(text) == answer


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory):
    texts = [p.prompt + p.solution for p in generate("add", 200, split="train")]
    tok = train_bpe(texts, 300, tmp_path_factory.mktemp("bpe"), extra_specials=CHAT_SPECIAL_TOKENS)
    return build_encoder(tok, "builtin", None)


class ScriptedModel(torch.nn.Module):
    """Stands in for a Transformer: after the prompt it writes `answers[row]` token by token,
    then `<|im_end|>`, whatever the cache says (a check of the decoding loop alone)."""

    def __init__(self, encoder, answers: dict[tuple[int, ...], str]):
        super().__init__()
        self.args = SimpleNamespace(n_layers=1, max_seq_len=512)
        self.register_buffer("rope", torch.zeros(1))
        tok = encoder.tokenizer
        end = tok.token_id("<|im_end|>")
        self.scripts = {p: [*tok.encode(a), end] for p, a in answers.items()}
        self.vocab, self.prompts, self.step = tok.vocab_size, [], 0

    def forward_cached(self, tokens_BT, cache):
        if tokens_BT.shape[1] > 1:  # prefill: remember which prompt each row is
            self.prompts, self.step = [tuple(r) for r in tokens_BT.tolist()], 0
        logits = torch.zeros(tokens_BT.shape[0], tokens_BT.shape[1], self.vocab)
        for b, p in enumerate(self.prompts):
            script = self.scripts[p]
            logits[b, -1, script[min(self.step, len(script) - 1)]] = 1.0
        self.step += 1
        return logits


def test_exact_match_decodes_each_prompt_until_the_end_of_turn(encoder) -> None:
    problems = [make_problem("add", a, b) for a, b in [(1, 2), (10, 20), (45, 67), (3, 4)]]
    wrong = {1: "#### 31", 3: "1 + 2 = 3\n"}  # a wrong answer, and one without ####
    answers = {
        tuple(encoder.prompt_ids(p.messages()[:1])): wrong.get(i, p.solution)
        for i, p in enumerate(problems)
    }
    model = ScriptedModel(encoder, answers)
    result = exact_match(model, encoder, problems, batch_size=2)
    assert result.completions[0] == problems[0].solution and result.completions[1] == "#### 31"
    assert (result.correct, result.total, result.accuracy) == (2, 4, 0.5)
    short = greedy_complete(model, encoder, [p.messages()[:1] for p in problems], max_new_tokens=3)
    assert all(len(encoder.tokenizer.encode(c)) <= 3 for c in short)


def test_a_short_sft_run_learns_from_answers_only(tmp_path) -> None:
    cfg = apply_overrides(
        get_config("sft_addition"),
        [
            "--job.output_dir",
            str(tmp_path / "out"),
            "--data.cache_dir",
            str(tmp_path / "cache"),
            "--model.flavor",
            "tiny",
            "--data.path",
            "add:1-2",
            "--data.num_problems",
            "800",
            "--training.steps",
            "30",
            "--training.batch_size",
            "4",
            "--training.seq_len",
            "128",
            "--lr_scheduler.warmup_steps",
            "3",
            "--metrics.log_every",
            "10",
            "--metrics.val_every",
            "30",
            "--metrics.val_batches",
            "2",
        ],
    )
    trainer = Trainer(cfg, log=lambda *a: None)
    batch = next(iter(trainer.data.train))
    assert (batch.labels == IGNORE_INDEX).float().mean() > 0.2  # prompts are left out
    first = float(trainer.train_step(*trainer.next_batches()[:2]).loss)
    last = trainer.train()
    assert last["loss"] < 0.6 * first
    problems = arithmetic.generate("add:1-2", 8, split="val")
    result = exact_match(trainer.model, trainer.data.chat, problems, max_new_tokens=40)
    assert result.total == 8 and len(result.completions) == 8
    assert all("<|im_start|>" not in c and "user" not in c for c in result.completions)


@pytest.mark.slow
def test_sft_addition_reaches_a_useful_accuracy(tmp_path) -> None:
    # The whole named config: about 11 minutes on a busy 2-core CPU (docs/sft.md), 65.6%.
    cfg = apply_overrides(get_config("sft_addition"), ["--job.output_dir", str(tmp_path)])
    trainer = Trainer(cfg, log=lambda *a: None)
    trainer.train()
    problems = arithmetic.generate(cfg.data.path, 200, split="val", seed=1234)
    assert exact_match(trainer.model, trainer.data.chat, problems).accuracy > 0.5
