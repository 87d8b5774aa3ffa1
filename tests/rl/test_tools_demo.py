"""`make demo-tools`: its SFT data (tidal/rl/envs/teacher.py) is what the `calculator`
environment's trajectories are, token for token, and a few steps of `rl_calculator`, shrunk,
run through `tidal rl` with the warm start trained from that data (30 s on 2 cores)."""

from __future__ import annotations

import json
import re

import pytest

from tests.rl._cli import records, tidal_rl
from tests.rl.test_envs import Script, params
from tidal.rl.envs import TurnCodec, get_env, run_trajectories
from tidal.rl.envs.teacher import parse_teacher_spec, teacher_chats
from tidal.rl.tasks import Problem
from tidal.train.data.chat import BUILTIN_TEMPLATE, ChatTemplate, build_encoder, training_text
from tidal.train.data.config import CHAT_SPECIAL_TOKENS, DataConfig
from tidal.train.data.tokenizer import train_bpe

SPEC = "calculator:tool=0.5:terms=2:digits=1-3:brief_tool=true"


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory):
    template = ChatTemplate(BUILTIN_TEMPLATE, name="builtin")
    texts = [training_text(template.render(c)) for c in teacher_chats(SPEC, 200, split="train")]
    tok = train_bpe(texts, 400, tmp_path_factory.mktemp("bpe"), extra_specials=CHAT_SPECIAL_TOKENS)
    return build_encoder(tok, "builtin", None)


@pytest.mark.parametrize("listed", [True, False])
def test_teacher_chats_are_the_environment_trajectories_token_for_token(encoder, listed):
    # Unlisted: the demo's form (no tool block, the hint before the question).
    env = get_env(
        "calculator",
        terms=2,
        digits=(1, 3),
        brief_tool=True,
        list_tools=listed,
        hint_first=not listed,
    )
    tools = [t.spec() for t in env.tools()]
    assert tools[0]["function"]["description"] == "Exact arithmetic."
    spec = SPEC if listed else SPEC + ":list_tools=false:hint_first=true"
    chats = teacher_chats(spec, 40, split="train")
    # Unlisted tools: no system turn (no tool block); the calls are written as when listed.
    assert (chats[0][0]["role"] == "system") == listed
    user = next(m["content"] for m in chats[0] if m["role"] == "user")
    assert user.startswith("What is") == listed and user.endswith("?") != listed
    with_tool = [c for c in chats if any(m["role"] == "tool" for m in c)]
    assert 8 < len(with_tool) < 32, len(with_tool)  # about half call the tool
    for chat in chats[:12]:
        replies = [m["content"] for m in chat if m["role"] == "assistant"]
        user = next(m["content"] for m in chat if m["role"] == "user")
        problem = Problem(user, str(int(replies[-1].removeprefix("#### "))))

        turns = iter(replies)  # the teacher's turns, one per round
        script = Script(encoder, lambda request, k, turns=turns: next(turns))
        (group,), counts = run_trajectories(
            env,
            [problem],
            TurnCodec(encoder, tools, list_tools=listed),
            script,
            [params(n=1)],
            max_context=512,
        )
        (t,) = group
        sft_ids, sft_mask = encoder.encode(chat)
        # The SFT sample ends with the template's newline after the last end-of-turn marker.
        assert sft_ids[: len(t.token_ids())] == t.token_ids()
        assert encoder.tokenizer.decode(sft_ids[len(t.token_ids()) :]) == "\n"
        assert t.turns == len(replies) and t.tool_calls == len(replies) - 1
        # Every sampled token is in the SFT loss; the SFT loss has besides only the newline
        # after an end-of-turn marker, which the environment appends as an observation.
        mask = sft_mask[len(t.prompt_ids) :]
        for k, trained in enumerate(t.loss_mask):
            if trained:
                assert mask[k] == 1
            elif mask[k]:
                assert encoder.tokenizer.decode([t.completion_ids[k]]) == "\n"
        assert sum(sft_mask[: len(t.prompt_ids)]) == 0
    # The teacher's tool answers are right and its guesses are wrong.
    for chat in chats:
        final = int(chat[-1]["content"].removeprefix("#### "))
        a, b, sign, c, d = re.search(
            r"What is (\d+) \* (\d+) ([+-]) (\d+) \* (\d+)\?",
            next(m["content"] for m in chat if m["role"] == "user"),
        ).groups()
        right = final == int(a) * int(b) + (1 if sign == "+" else -1) * int(c) * int(d)
        assert right == any(m["role"] == "tool" for m in chat)


def test_teacher_spec_errors_and_the_generated_dataset():
    assert parse_teacher_spec("calculator:tool=0.25:terms=2:digits=1-3") == (
        "calculator",
        0.25,
        {"terms": 2, "digits": (1, 3)},
    )
    assert parse_teacher_spec("calculator:terms=1:digits=3:brief_tool=true")[1:] == (
        0.5,
        {"terms": 1, "digits": 3, "brief_tool": True},
    )
    for bad, needle in [
        ("guess:tool=0.5", "no teacher"),
        ("calculator:brief_tool=yes", "integer, MIN-MAX, true or false"),
        ("calculator:tool=2", "must be in [0, 1]"),
        ("calculator:colour=3", "no parameter 'colour'"),
        ("calculator:terms", "KEY=VALUE"),
    ]:
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            parse_teacher_spec(bad)
    a = teacher_chats(SPEC, 50, split="train")
    assert a == teacher_chats(SPEC, 50, split="train")
    prompts = {json.dumps(c[1]) for c in a}
    assert not prompts & {json.dumps(c[1]) for c in teacher_chats(SPEC, 50, split="val")}
    with pytest.raises(ValueError, match="MODULE:FUNCTION"):
        DataConfig(dataset="generated", format="chat", path="teacher_chats")
    with pytest.raises(ValueError, match="format='chat'"):
        DataConfig(dataset="generated", path="tidal.rl.envs.teacher:teacher_chats:" + SPEC)


def test_a_few_steps_of_the_tools_demo(tmp_path, cache_dir):
    out = tmp_path / "run"
    r = tidal_rl(
        "--config",
        "rl_calculator",
        "--policy.sft_overrides",
        "model.flavor=tiny training.steps=30 training.batch_size=4 data.num_problems=500 "
        # 4% held out: 20 conversations, enough windows of 256 tokens for a batch of 4.
        "data.vocab_size=600 data.val_fraction=0.04 metrics.val_every=0",
        "--policy.cache_dir",
        str(cache_dir),
        "--task.eval_problems",
        "4",
        "--rollout.prompts_per_step",
        "2",
        "--rollout.group_size",
        "4",
        "--rl.steps",
        "2",
        "--rl.eval_every",
        "2",
        "--job.device",
        "cpu",
        "--generator.device",
        "cpu",
        "--job.output_dir",
        str(out),
        timeout=400,
    )
    assert r.returncode == 0, r.stdout
    steps, evals = records(out)
    assert [s["step"] for s in steps] == [1, 2]
    assert all("tool_calls_mean" in s and "turns_mean" in s for s in steps)
    assert sorted(e["step"] for e in evals) == [0, 2]
    assert (out / "rl.png").is_file()
