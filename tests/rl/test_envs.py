"""The environment API and the multi-turn driver with a scripted model: trajectories keep
exact token ids (sampled ones trained on, observations masked), tools run and their errors
stay inside the trajectory, limits end trajectories, and bad input is a clear error or a
counted failure; the built-in environments' problems and graders."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from tidal.generate import Sample
from tidal.rl.config import RolloutConfig
from tidal.rl.envs import (
    ENVS,
    Env,
    Step,
    TaskEnv,
    Trajectory,
    Turn,
    TurnCodec,
    TurnRequest,
    get_env,
    register_env,
    run_trajectories,
    sample_env_batch,
)
from tidal.rl.loss import LossConfig, group_advantages
from tidal.rl.rollout import RolloutBatch
from tidal.rl.tasks import Problem
from tidal.rl.trainer_inputs import rollout_batches
from tidal.train.data.chat import ChatEncoder, ChatTemplate, build_encoder
from tidal.train.data.config import CHAT_SPECIAL_TOKENS
from tidal.train.data.tokenizer import Tokenizer, train_bpe
from tidal.train.loss import IGNORE_INDEX

WORDS = (
    "what is the number higher lower guess reply with one from to tool call calc python "
    "expression arguments name answer of sum prime digits integers"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    texts = [WORDS, '{"name": "calc", "arguments": {"expression": "12 * 34"}}', "0123456789 #"]
    return train_bpe(
        texts * 20, 400, tmp_path_factory.mktemp("bpe"), extra_specials=CHAT_SPECIAL_TOKENS
    )


@pytest.fixture(scope="module")
def encoder(tok: Tokenizer) -> ChatEncoder:
    return build_encoder(tok, "builtin", None)


class Script:
    """A `generate_turn` that answers from a script: `reply(request, k) -> text`, sampled as
    the text's tokens then the end-of-turn token, with made-up log-probs and version 7."""

    def __init__(self, encoder: ChatEncoder, reply, stop: bool = True) -> None:
        self.encoder, self.reply, self.stop, self.rounds = encoder, reply, stop, []

    def __call__(self, requests: list[TurnRequest]) -> list[list[Sample]]:
        self.rounds.append(requests)
        tok, out = self.encoder.tokenizer, []
        end = tok.encode(self.encoder.stop_text, special_tokens=True)
        for r in requests:
            group = []
            for k in range(r.params.n):
                text = self.reply(r, k)
                ids = tok.encode(text) + (end if self.stop else [])
                full = len(ids)
                ids = ids[: r.params.max_new_tokens]
                n = len(ids)
                text = tok.decode([i for i in ids if i not in end])  # as the Generator does
                group.append(
                    Sample(
                        prompt_index=0,
                        sample_index=k,
                        prompt_ids=r.token_ids,
                        completion_ids=ids,
                        text=text,
                        finish_reason="stop" if self.stop and n == full else "length",
                        logprobs=[-0.5] * n,
                        sampling_logprobs=[-0.25] * n,
                        weight_version=7,
                    )
                )
            out.append(group)
        return out


def params(n: int = 2, max_new_tokens: int = 64, seed: int = 3):
    from tidal.generate import SamplingParams

    return SamplingParams(n=n, max_new_tokens=max_new_tokens, seed=seed)


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def check_token_exact(t: Trajectory, encoder: ChatEncoder, tools=None) -> None:
    """The trajectory's ids are those of its whole conversation rendered at once (the turns'
    text is tokenized alike here), and its per-token lists line up."""
    n = len(t.completion_ids)
    assert len(t.loss_mask) == len(t.logprobs) == len(t.versions) == n
    from tidal.rl.envs.tool_calls import render_chat

    text = render_chat(encoder.template, t.messages, tools, add_generation_prompt=False)
    got = encoder.tokenizer.decode(t.token_ids(), skip_special_tokens=False)
    bos = encoder.tokenizer.token_text(encoder.tokenizer.bos_id)
    assert got.removeprefix(bos).startswith(text.rstrip("\n"))
    for k in range(n):
        if not t.loss_mask[k]:
            assert t.logprobs[k] == 0.0 and t.versions[k] == -1
        else:
            assert t.logprobs[k] == -0.5 and t.versions[k] == 7


# -- the API ----------------------------------------------------------------------------------


def test_unknown_environment_and_parameter():
    with pytest.raises(ValueError, match=r"unknown environment 'nope'; environments: \[.*'guess'"):
        get_env("nope")
    with pytest.raises(TypeError, match="environment 'guess' has no parameter 'size'"):
        get_env("guess", size=3)
    with pytest.raises(ValueError, match=r"Guess needs low < high // 2"):
        get_env("guess", low=5, high=5)
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        get_env("guess", max_turns=0)
    with pytest.raises(ValueError, match="is a task's"):
        register_env("addition")(type("X", (Env,), {}))
    assert {"calculator", "python", "guess"} <= set(ENVS)


def test_a_task_is_a_one_turn_environment():
    env = get_env("addition", digits=2)
    assert isinstance(env, TaskEnv) and env.name == "addition" and env.max_turns == 1
    task = env.task
    assert list(zip(range(5), env.problems("train", seed=4), strict=False)) == list(
        zip(range(5), task.problems("train", seed=4), strict=False)
    )
    p = next(env.problems("eval"))
    assert env.reset(p) == [{"role": "user", "content": p.prompt}]
    step = env.step(env.parse(f"#### {p.reference}", 0, last=True, calls_left=0, finish="stop"))
    assert step.done and step.reward == 1.0 and step.answer == p.reference


def test_environment_problems_are_split_and_seeded():
    env = get_env("calculator")
    train = [p for _, p in zip(range(50), env.problems("train", seed=1), strict=False)]
    again = [p for _, p in zip(range(50), env.problems("train", seed=1), strict=False)]
    evals = env.eval_set(20)
    assert train == again
    assert not {p.prompt for p in train} & {p.prompt for p in evals}
    expr = train[0].prompt.removeprefix("What is ").split("?")[0]
    assert str(eval(expr)) == train[0].reference  # the reference is the expression's value


# -- the driver -------------------------------------------------------------------------------


def test_guess_game_trajectories(encoder):
    env = get_env("guess", low=1, high=9, max_turns=4)
    problem = Problem("Guess.", {"target": 6, "high": 9})
    guesses = {0: ["3", "7", "6"], 1: ["1", "2", "3", "4", "5"]}  # sample 0 wins in 3

    def reply(r: TurnRequest, k: int) -> str:
        j = k if r.params.n > 1 else r.key[1]
        done = encoder.tokenizer.decode(r.token_ids, skip_special_tokens=False).count(
            "<|im_start|>assistant"
        )
        return f"my guess {guesses[j][done - 1]}"

    script = Script(encoder, reply)
    codec = TurnCodec(encoder)
    (group,), counts = run_trajectories(env, [problem], codec, script, [params()], max_context=512)
    win, lose = group
    assert (win.finish, win.reward, win.turns, win.answer) == ("done", 1.0, 3, "6")
    assert (lose.finish, lose.reward, lose.turns) == ("max_turns", 0.0, 4)
    assert [m["content"] for m in win.messages if m["role"] == "user"][1:] == ["Higher.", "Lower."]
    for t in group:
        check_token_exact(t, encoder)
    # one request for the group's first turn, then one per live trajectory
    assert [len(r) for r in script.rounds] == [1, 2, 2, 1]
    assert script.rounds[0][0].params.n == 2 and script.rounds[1][0].params.n == 1
    seeds = {r.params.seed for rnd in script.rounds[1:] for r in rnd}
    assert len(seeds) == 5  # every later turn its own seed
    # what a cache-continuing engine would prefill: only the ids after its last request
    r1 = script.rounds[1][0]
    assert r1.new_from == len(script.rounds[0][0].token_ids)
    assert counts["turns"] == 7 and counts["env_errors"] == 0


def test_trajectories_train_only_on_sampled_tokens(encoder):
    env = get_env("guess", low=1, high=9, max_turns=3)
    script = Script(encoder, lambda r, k: "5")
    problems = [
        Problem("Guess.", {"target": 5, "high": 9}),
        Problem("Guess.", {"target": 8, "high": 9}),
    ]
    groups, _ = run_trajectories(
        env, problems, TurnCodec(encoder), script, [params(), params()], max_context=512
    )
    trajs = [t for g in groups for t in g]
    batch = RolloutBatch.from_trajectories(trajs, task="guess", group_ids=[0, 0, 1, 1], pad_id=0)
    assert torch.equal(batch.train_mask, batch.loss_mask)
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert int(batch.loss_mask.sum()) == sum(sum(t.loss_mask) for t in trajs)
    assert int(batch.completion_mask.sum()) > int(batch.loss_mask.sum())  # observations
    # the store round trip keeps the mask; concat with a single-turn batch keeps both
    again = RolloutBatch.from_state_dict(batch.to_state_dict())
    assert torch.equal(again.loss_mask, batch.loss_mask)
    both = RolloutBatch.concat([batch, batch.select([0, 1])])
    assert torch.equal(both.loss_mask[:4, : batch.loss_mask.shape[1]], batch.loss_mask)
    # trainer rows: labels only on sampled tokens, observation tokens are inputs only
    adv = group_advantages(batch.rewards, batch.group_ids, LossConfig(drop_equal_groups=False))
    (b,) = rollout_batches(batch, adv, micro_batch_size=4)
    ids = batch.token_ids()
    for i, t in enumerate(trajs):
        p, c = len(t.prompt_ids), len(t.completion_ids)
        assert ids[i, : p + c].tolist() == t.token_ids()
        labels = b.labels[i, p - 1 : p - 1 + c]
        want = torch.where(torch.tensor(t.loss_mask), torch.tensor(t.completion_ids), IGNORE_INDEX)
        assert torch.equal(labels, want)
        assert (b.labels[i, : p - 1] == IGNORE_INDEX).all()
        assert torch.equal(b.extras["mask"][i, p - 1 : p - 1 + c], torch.tensor(t.loss_mask))
        gen = b.extras["gen_logprobs"][i, p - 1 : p - 1 + c]
        assert torch.equal(gen, torch.tensor(t.logprobs))


def test_calculator_tool_calls_and_errors(encoder):
    env = get_env("calculator", max_turns=4, max_tool_calls=3)
    problem = Problem("What is 12 * 34 + 5 * 6?", "438")
    replies = {
        0: [call("calc", expression="12 * 34 + 5 * 6"), "#### 438"],
        1: [
            call("python", code="print(1)") + "<tool_call>{oops</tool_call>",
            call("calc", expression="12 * 34") + call("calc", expression="5 * 6"),
            "#### 437",
        ],
    }

    def reply(r: TurnRequest, k: int) -> str:
        j = k if r.params.n > 1 else r.key[1]
        done = encoder.tokenizer.decode(r.token_ids, skip_special_tokens=False).count(
            "<|im_start|>assistant"
        )
        return replies[j][done - 1]

    codec = TurnCodec(encoder, [t.spec() for t in env.tools()])
    (group,), counts = run_trajectories(
        env,
        [problem],
        codec,
        Script(encoder, reply),
        [params(max_new_tokens=200)],
        max_context=2048,
    )
    good, bad = group
    assert (good.finish, good.reward, good.tool_calls, good.tool_errors) == ("done", 1.0, 1, 0)
    tool_msgs = [m for m in good.messages if m["role"] == "tool"]
    assert tool_msgs == [{"role": "tool", "name": "calc", "content": "438"}]
    assert (bad.finish, bad.reward, bad.tool_calls) == ("done", 0.0, 4)
    results = [m["content"] for m in bad.messages if m["role"] == "tool"]
    assert results[0].startswith("Tool error: tool call 1: unknown tool 'python'")
    assert results[1].startswith("Tool error: tool call 2 is not valid JSON")
    assert results[2] == "408"
    assert results[3].startswith("Tool error: the limit of 3 tool calls is reached")
    assert bad.tool_errors == 3 and counts["tool_errors"] == 3 and counts["tool_calls"] == 5
    prompt = encoder.tokenizer.decode(good.prompt_ids, skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "calc"' in prompt
    assert "<tool_response>\n438\n</tool_response>" in encoder.tokenizer.decode(
        good.completion_ids, skip_special_tokens=False
    )
    for t in group:
        check_token_exact(t, encoder, [s.spec() for s in env.tools()])


def test_a_turn_cut_by_its_token_limit_gets_the_end_marker_as_observation(encoder):
    env = get_env("guess", low=1, high=9, max_turns=2)
    script = Script(encoder, lambda r, k: "my guess is three", stop=False)
    (group,), _ = run_trajectories(
        env,
        [Problem("Guess.", {"target": 3, "high": 9})],
        TurnCodec(encoder),
        script,
        [params(n=1, max_new_tokens=3)],
        max_context=512,
    )
    (t,) = group
    assert t.finish == "max_turns" and t.truncated
    obs = [i for i, m in zip(t.completion_ids, t.loss_mask, strict=True) if not m]
    text = encoder.tokenizer.decode(obs, skip_special_tokens=False)
    assert text.startswith("<|im_end|>\n<|im_start|>user\n")


def test_a_conversation_longer_than_the_context_ends_truncated(encoder):
    env = get_env("guess", low=1, high=9, max_turns=50)
    script = Script(encoder, lambda r, k: "one two three four")
    codec = TurnCodec(encoder)
    (group,), counts = run_trajectories(
        env,
        [Problem("Guess.", {"target": 3, "high": 9})],
        codec,
        script,
        [params(n=2)],
        max_context=120,
    )
    assert [t.finish for t in group] == ["context", "context"]
    assert all(t.truncated and t.reward == 0.0 for t in group)
    assert all(len(t.token_ids()) <= 120 for t in group)
    assert counts["context_truncated"] == 2
    for rnd in script.rounds:  # no request ever asked for more than the context holds
        for r in rnd:
            assert len(r.token_ids) + r.params.max_new_tokens <= 120


@register_env("test_flaky")
@dataclass(kw_only=True)
class Flaky(Env):
    """Raises in step for odd references, in reset for reference 99."""

    max_turns: int = 2

    def problem(self, rng):
        return Problem("Say hi.", rng.randrange(4))

    def reset(self, problem):
        if problem.reference == 99:
            raise RuntimeError("no such level")
        return super().reset(problem)

    def step(self, turn):
        if self.reference % 2:
            raise KeyError("broken grader")
        return Step(done=True, reward=1.0)


def test_an_environment_that_raises_costs_its_reward_and_is_counted(encoder):
    env = Flaky()
    script = Script(encoder, lambda r, k: "hi")
    problems = [Problem("a", 0), Problem("b", 1), Problem("c", 99)]
    groups, counts = run_trajectories(
        env, problems, TurnCodec(encoder), script, [params()] * 3, max_context=256
    )
    assert [t.reward for t in groups[0]] == [1.0, 1.0]
    assert [(t.finish, t.reward) for t in groups[1]] == [("error", 0.0)] * 2
    assert groups[1][0].error == "KeyError: 'broken grader'"
    assert [t.finish for t in groups[2]] == ["error", "error"] and not groups[2][0].prompt_ids
    assert counts["env_errors"] == 3  # two trajectories in step, one group in reset
    assert counts["env_error"] == "RuntimeError: no such level"  # the first one


def test_sample_env_batch_drops_groups_whose_reset_raised(encoder):
    env = Flaky()
    env.problem = lambda rng: Problem("x", [0, 99][rng.randrange(2)])  # type: ignore[method-assign]
    policy = SimpleNamespace(
        encoder=encoder, pad_id=0, max_prompt_tokens=64, generator=SimpleNamespace(capacity=256)
    )
    policy.stop = (1,)
    cfg = SimpleNamespace(rollout=RolloutConfig(prompts_per_step=6, group_size=2))
    batch = sample_env_batch(
        policy,
        env,
        cfg,
        seeds=(0, 1, 0),
        n_prompts=6,
        generate_turn=Script(encoder, lambda r, k: "hi"),
    )
    assert batch.num_samples < 12 and batch.num_samples % 2 == 0
    assert batch.meta["env_errors"] == (12 - batch.num_samples) // 2
    assert batch.rewards.tolist() == [1.0] * batch.num_samples


def test_template_without_tool_support_is_refused_before_any_work(tok):
    template = ChatTemplate(
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}\n{% endfor %}",
        name="strict.jinja",
    )
    encoder = ChatEncoder(tok, template)
    with pytest.raises(ValueError, match="chat template strict.jinja has no tool support"):
        TurnCodec(encoder, [t.spec() for t in get_env("calculator").tools()])
    TurnCodec(encoder)  # a game without tools is fine


def test_opening_longer_than_max_prompt_tokens_is_an_error(encoder):
    env = get_env("calculator")
    codec = TurnCodec(encoder, [t.spec() for t in env.tools()])
    with pytest.raises(ValueError, match=r"over rollout.max_prompt_tokens=20"):
        run_trajectories(
            env,
            [Problem("What is 1 * 1?", "1")],
            codec,
            Script(encoder, lambda r, k: "#### 1"),
            [params()],
            max_context=4096,
            max_prompt_tokens=20,
        )


# -- built-in environments --------------------------------------------------------------------


def test_guess_has_a_held_out_set_the_size_of_a_task():
    env = get_env("guess")
    held_out = env.eval_set(200)
    assert len({env.key(p) for p in held_out}) == 200
    for p in held_out[:20]:
        top = p.reference["high"]
        assert 50 <= top <= 100 and 1 <= p.reference["target"] <= top
        assert f"from 1 to {top} in 7 tries" in p.prompt


def test_guess_feedback_and_limits():
    env = get_env("guess", low=1, high=20, max_turns=5).episode()
    env.reset(Problem("g", {"target": 12, "high": 20}))

    def turn(text: str, i: int = 0) -> Step:
        return env.step(Turn(text=text, content=text, index=i))

    assert turn("10").messages == [{"role": "user", "content": "Higher."}]
    assert turn("I say 15").messages == [{"role": "user", "content": "Lower."}]
    assert "one number from 1 to 20" in turn("no idea").messages[0]["content"]
    step = turn("12")
    assert step.done and step.reward == 1.0


def test_python_env_problems_and_grading():
    env = get_env("python", kinds=["primes", "multiples"])
    problems = [p for _, p in zip(range(6), env.problems("train"), strict=False)]
    for p in problems:
        assert p.prompt.startswith(("How many prime", "How many integers"))
        if p.prompt.startswith("How many prime"):
            n = int(p.prompt.split("less than ")[1].split("?")[0])
            assert int(p.reference) == sum(all(k % d for d in range(2, k)) for k in range(2, n))
    with pytest.raises(ValueError, match=r"kinds: unknown \['cubes'\]"):
        get_env("python", kinds=["cubes"])
    env = env.episode()
    env.reset(problems[0])
    assert env.grade(Turn(text="", content=f"#### {problems[0].reference}", index=0)).reward == 1.0
    assert env.grade(Turn(text="", content=str(problems[0].reference), index=0)).reward == 0.0
    assert [t.name for t in env.tools()] == ["python"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's limits")
def test_python_env_runs_model_code_in_the_sandbox(encoder):
    from tidal.rl.tools import SandboxConfig

    env = get_env("python", sandbox=SandboxConfig(wall_seconds=20.0, cpu_seconds=1))
    problem = Problem("What is the sum of the squares of the integers from 1 to 10?", "385")
    code = {0: "print(sum(i * i for i in range(1, 11)))", 1: "while True: pass"}

    def reply(r: TurnRequest, k: int) -> str:
        j = k if r.params.n > 1 else r.key[1]
        if r.new_from == 0:
            return call("python", code=code[j])
        return "#### 385" if j == 0 else "I cannot tell."

    codec = TurnCodec(encoder, [t.spec() for t in env.tools()])
    (group,), counts = run_trajectories(
        env,
        [problem],
        codec,
        Script(encoder, reply),
        [params(max_new_tokens=200)],
        max_context=4096,
    )
    good, bad = group
    assert [m["content"] for m in good.messages if m["role"] == "tool"] == ["385"]
    assert (good.reward, good.turns) == (1.0, 2)
    (result,) = [m["content"] for m in bad.messages if m["role"] == "tool"]
    assert result.startswith("Tool error:") and "CPU time" in result
    assert (bad.reward, bad.tool_errors, counts["tool_errors"]) == (0.0, 1, 1)


@register_env("test_steps")
@dataclass(kw_only=True)
class Steps(Env):
    """Pays 0.25 a turn, then 0.5 at the end of the third."""

    max_turns: int = 5

    def problem(self, rng):
        return Problem("Count to three.", 3)

    def step(self, turn):
        if turn.index == 2:
            return Step(done=True, reward=0.5, answer="3", format_ok=True)
        return Step(messages=[{"role": "user", "content": "Go on."}], reward=0.25)


def test_per_turn_rewards_add_up(encoder):
    (group,), _ = run_trajectories(
        Steps(),
        [Problem("Count.", 3)],
        TurnCodec(encoder),
        Script(encoder, lambda r, k: "one"),
        [params(n=1)],
        max_context=512,
    )
    (t,) = group
    assert t.turn_rewards == [0.25, 0.25, 0.5] and t.reward == 1.0 and t.finish == "done"
    assert (t.answer, t.format_ok) == ("3", True)


def test_template_that_rewrites_the_assistant_text_is_refused(tok):
    template = ChatTemplate(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}{{ '\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
        name="shout.jinja",
    )
    encoder = ChatEncoder(tok, template)  # fine for SFT: its turns are prefixes
    with pytest.raises(ValueError, match="shout.jinja does not write an assistant turn's text"):
        TurnCodec(encoder)


# Qwen 3's way: the last assistant turn after the last user query gets an (empty) think
# block; once a turn follows, it is written without one. Earlier turns change, and that is
# fine: they are never re-tokenized.
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_still_appends_tokens(tok):
    encoder = ChatEncoder(tok, ChatTemplate(QWEN3_LIKE, name="qwen3-like"))
    env = get_env("guess", max_turns=2)
    script = Script(encoder, lambda r, k: "5")
    (group,), _ = run_trajectories(
        env,
        [Problem("Guess.", {"target": 3, "high": 9})],
        TurnCodec(encoder),
        script,
        [params(n=1)],
        max_context=256,
    )
    (t,) = group
    text = encoder.tokenizer.decode(t.token_ids(), skip_special_tokens=False)
    assert text.endswith(
        "<|im_start|>user\nGuess.<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
        "<|im_start|>user\nLower.<|im_end|>\n<|im_start|>assistant\n5<|im_end|>"
    )
    assert "<think>" not in text  # what the model saw: no think block was ever given


def test_reset_must_depend_on_the_problem_only(encoder):
    env = get_env("guess")
    rng = random.Random(0)
    env.reset = lambda problem: [{"role": "user", "content": f"Guess {rng.random()}"}]
    with pytest.raises(ValueError, match="reset gave different opening messages"):
        run_trajectories(
            env,
            [Problem("Guess.", {"target": 3, "high": 9})],
            TurnCodec(encoder),
            Script(encoder, lambda r, k: "3"),
            [params(n=2)],
            max_context=256,
        )


def test_a_template_with_its_own_tool_format(tok):
    from tests.rl.test_tool_calls import QWEN_LIKE

    encoder = ChatEncoder(tok, ChatTemplate(QWEN_LIKE, name="qwen-like"))
    env = get_env("calculator")
    replies = [call("calc", expression="12 * 34"), "#### 408"]

    def reply(r: TurnRequest, k: int) -> str:
        return replies[0 if r.new_from == 0 else 1]

    codec = TurnCodec(encoder, [t.spec() for t in env.tools()])
    (group,), _ = run_trajectories(
        env,
        [Problem("What is 12 * 34?", "408")],
        codec,
        Script(encoder, reply),
        [params(n=1, max_new_tokens=100)],
        max_context=2048,
    )
    (t,) = group
    assert (t.reward, t.tool_calls, t.turns) == (1.0, 1, 2)
    prompt = encoder.tokenizer.decode(t.prompt_ids, skip_special_tokens=False)
    assert "# Tools" not in prompt and "<tools>\n" in prompt  # the template's own block
    obs = [i for i, m in zip(t.completion_ids, t.loss_mask, strict=True) if not m]
    assert encoder.tokenizer.decode(obs, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
