"""Trajectories: multi-turn conversations kept as the exact token ids the trainer trains on.

A trajectory is the opening prompt's ids followed by its completion: the tokens the generator
sampled, turn after turn, and between them the environment's observations (tool results, user
or game messages, with the template's turn markers), appended as tokens:

    prompt | sampled turn 0 | observation 0 | sampled turn 1 | ...
             mask 1           mask 0          mask 1

- Sampled tokens are trained on, each with its generator log-prob and policy version.
- Observation tokens are masked out of the loss (`RolloutBatch.loss_mask`), log-prob 0,
  version -1.
- Earlier turns are never re-tokenized: only the observation's new text is encoded
  (`TurnCodec.observation`), so the ids the trainer scores are the ids the generator saw.
- With the generator's `record_routing` (routing replay), `routed_experts` holds the experts
  of every position the generator ran, observations included (the next turn prefills them).

The driver (`run_trajectories`) plays a batch of problems, `group_size` trajectories each,
turn by turn: every round, one `generate_turn` call for every live trajectory. The first
turn of a group is one request with n = group_size (as a single-turn batch is, so a one-turn
task gives the very samples `sample_batch` gives); later turns are one request each, seeded by
(group, trajectory, turn).

`generate_turn(requests) -> groups` is the engine: `FromCache(generator)` continues each
trajectory from its KV-cache row, prefilling only the observation (what `sample_env_batch`
uses for a multi-turn environment whose batch fits the generator's rows);
`resubmit(generator)` sends each request's whole token ids to `Generator.generate`
(token-exact, the prefix prefilled again).

Bad input: an environment that raises (in `reset`, `step`, or its grader) ends that
trajectory with reward 0, counted in `meta["env_errors"]` with the first message; a
conversation that would outgrow `max_context` ends truncated (`truncated`, counted in
`meta["context_truncated"]`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from tidal.generate import Sample, SamplingParams
from tidal.rl.envs.base import Env, Messages, Step
from tidal.rl.envs.tool_calls import render_chat, tool_format
from tidal.rl.tasks.base import Problem

if TYPE_CHECKING:
    from tidal.rl.config import RLConfig
    from tidal.rl.experience import Policy
    from tidal.rl.rollout import RolloutBatch
    from tidal.train.data.chat import ChatEncoder

_PLACEHOLDER = "\x00tidal-turn\x00"


@dataclass(kw_only=True, slots=True)
class Trajectory:
    """One conversation as token ids, with what the loss and the logs need."""

    prompt_ids: list[int]
    """The opening messages rendered with the generation prompt (BOS first)."""
    completion_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: sampled turns and observations."""
    loss_mask: list[bool] = field(default_factory=list)
    """Per completion token: sampled (trained on) or observation (masked out)."""
    logprobs: list[float] = field(default_factory=list)
    """The generator's log-prob per completion token; 0 on observations."""
    sampling_logprobs: list[float] = field(default_factory=list)
    """Log-prob under the distribution sampled; 0 on observations."""
    versions: list[int] = field(default_factory=list)
    """Policy version per completion token; -1 on observations and unversioned weights."""
    messages: Messages = field(default_factory=list)
    """The conversation as text: opening, then the model's turns and the observations."""
    turn_rewards: list[float] = field(default_factory=list)
    """Each step's reward (the last is the final one)."""
    answer: str | None = None
    format_ok: bool = False
    turns: int = 0
    """Assistant turns played."""
    tool_calls: int = 0
    """Tool calls the model wrote (malformed ones included)."""
    tool_errors: int = 0
    """Tool results that were errors."""
    finish: str = ""
    """"done" (the environment ended it), "max_turns", "context" (it outgrew the context) or
    "error" (the environment raised); "" while it runs."""
    last_finish_reason: str = "stop"
    """The last sampled turn's: "stop" or "length"."""
    error: str = ""
    """The environment's exception, when `finish` is "error"."""
    routed_experts: torch.Tensor | None = None
    """With the generator's `record_routing`: the experts each MoE layer routed the
    conversation's tokens to, [MoE layers, positions, top_k] over `token_ids()` (the
    trainer's input positions), as `Sample.routed_experts` is for one sample. Every turn's
    sample records the whole conversation it ran (the observations before it included, which
    the generator prefilled); a turn adds the positions not yet recorded, so each token keeps
    the experts that routed it when the generator first ran it. The tail after the last
    sampled turn (its last token, a trailing observation) is never run, so never recorded.
    None without records."""

    @property
    def reward(self) -> float:
        """The sum of the turns' rewards (0 for an error)."""
        return 0.0 if self.finish == "error" else float(sum(self.turn_rewards))

    @property
    def truncated(self) -> bool:
        """It outgrew the context, or its last turn hit the token limit."""
        return self.finish == "context" or self.last_finish_reason == "length"

    def token_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.completion_ids]

    def add_sampled(self, s: Sample) -> None:
        """Append a sampled turn: its tokens, log-probs and versions, and the routing records
        of the positions it ran first (`routed_experts`).

        Raises:
            ValueError: the sample's routing records do not cover the conversation and its
                completion (layers, `len(token_ids()) + completion - 1`, top_k), or the
                trajectory holds records and the sample brings none (or another layout)."""
        self._add_routing(s)
        n = len(s.completion_ids)
        self.completion_ids += s.completion_ids
        self.loss_mask += [True] * n
        self.logprobs += s.logprobs
        self.sampling_logprobs += s.sampling_logprobs
        if s.versions is not None:
            self.versions += s.versions
        else:
            v = -1 if s.weight_version is None else s.weight_version
            self.versions += [v] * n
        self.last_finish_reason = s.finish_reason

    def _add_routing(self, s: Sample) -> None:
        r, have = s.routed_experts, self.routed_experts
        if r is None:
            if have is not None:
                raise ValueError(
                    "a turn's sample carries no routing records (routed_experts) and the "
                    "trajectory's earlier turns do"
                )
            return
        want = len(self.prompt_ids) + len(self.completion_ids) + len(s.completion_ids) - 1
        if r.dim() != 3 or r.shape[1] != want:
            raise ValueError(
                f"a turn's routed_experts has shape {tuple(r.shape)}; the conversation needs "
                f"[layers, {want}, top_k] (its {len(self.token_ids())} tokens and the turn's "
                f"{len(s.completion_ids)}, but the last)"
            )
        if have is None:
            if self.completion_ids:  # a trajectory without records until now
                raise ValueError(
                    "a turn's sample carries routing records (routed_experts) and the "
                    "trajectory's earlier turns do not"
                )
            self.routed_experts = r.clone()
            return
        if (r.shape[0], r.shape[2], r.dtype) != (have.shape[0], have.shape[2], have.dtype):
            raise ValueError(
                f"a turn's routed_experts {r.dtype} {tuple(r.shape)} differ in layers, top_k "
                f"or dtype from the trajectory's {have.dtype} {tuple(have.shape)}"
            )
        self.routed_experts = torch.cat([have, r[:, have.shape[1] :]], 1)

    def add_observation(self, ids: Sequence[int]) -> None:
        n = len(ids)
        self.completion_ids += ids
        self.loss_mask += [False] * n
        self.logprobs += [0.0] * n
        self.sampling_logprobs += [0.0] * n
        self.versions += [-1] * n


def env_codec(encoder: ChatEncoder, env: Env) -> TurnCodec:
    """The `TurnCodec` of `env`'s conversations: its tools, listed or not (`Env.list_tools`)."""
    return TurnCodec(encoder, [t.spec() for t in env.tools()], list_tools=env.list_tools)


class TurnCodec:
    """Messages to token ids for one environment's conversations: the opening prompt, and each
    observation alone with the template's turn markers around it.

    Raises (constructor):
        ValueError: the environment has tools and the template has no tool support, or the
            template does not write an assistant turn's text as it is (what follows it could
            not be appended as tokens).
    """

    def __init__(
        self,
        encoder: ChatEncoder,
        tools: list[dict[str, Any]] | None = None,
        *,
        list_tools: bool = True,
    ) -> None:
        if tools:
            tool_format(encoder.template)  # a template without tool support fails here
        # Unlisted tools (Env.list_tools False): no tool block in the opening; calls and tool
        # turns are still written in the template's tool format.
        self.encoder, self.tools = encoder, (tools or None) if list_tools else None
        tok = encoder.tokenizer
        stop = encoder.stop_text
        ids = tok.encode(stop, special_tokens=True) if stop else []
        self._stop_id = ids[0] if len(ids) == 1 else None
        # A template that rewrites the assistant's text fails here, before any work.
        reply = {"role": "tool" if tools else "user", "content": "Probe."}
        self.observation([{"role": "user", "content": "Hi"}, {}], [reply], None)

    def _render(self, messages: Messages, generation_prompt: bool) -> str:
        return render_chat(
            self.encoder.template, messages, self.tools, add_generation_prompt=generation_prompt
        )

    def opening(self, messages: Messages) -> list[int]:
        """The prompt's ids: `messages` and the generation prompt, BOS first (without tools
        exactly `ChatEncoder.prompt_ids`)."""
        if not self.tools:
            return self.encoder.prompt_ids(messages)
        tok = self.encoder.tokenizer
        ids = tok.encode(self._render(messages, True), special_tokens=True)
        return ids if ids and ids[0] == tok.bos_id else [tok.bos_id, *ids]

    def observation(self, history: Messages, new: Messages, last_id: int | None) -> list[int]:
        """The ids that follow a sampled turn: the rest of the assistant turn's end marker
        (what the model did not sample of it), the `new` messages and the next generation
        prompt. `history` ends with the assistant turn; `last_id` is its last sampled id.

        The text is what the template writes after the assistant's content when the
        conversation goes on with `new` (the turn's content stands in as a placeholder): the
        turns before are never rendered into ids again, so a template that writes earlier
        turns differently once more follow (Qwen 3 drops their reasoning) is fine."""
        convo = [*history[:-1], {"role": "assistant", "content": _PLACEHOLDER}, *new]
        text = self._render(convo, True)
        if text.count(_PLACEHOLDER) != 1:
            raise ValueError(
                f"chat template {self.encoder.template.name} does not write an assistant "
                "turn's text as it is, so what follows it cannot be found and appended as "
                "tokens; use --data.chat_template builtin or a template that does"
            )
        tail = text[text.index(_PLACEHOLDER) + len(_PLACEHOLDER) :]
        stop = self.encoder.stop_text
        if last_id is not None and last_id == self._stop_id and tail.startswith(stop):
            tail = tail[len(stop) :]  # the model sampled the end-of-turn token itself
        return self.encoder.tokenizer.encode(tail, special_tokens=True)


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """One generation request of a round."""

    key: tuple[int, int]
    """(group, trajectory) of the first trajectory it serves (a first turn serves the group's
    n trajectories from one request)."""
    token_ids: list[int]
    """The whole conversation so far."""
    new_from: int
    """Position of the first id not yet given to the engine for this trajectory (0 on a first
    turn): what an engine continuing from its cache prefills."""
    params: SamplingParams


GenerateTurn = Callable[[list[TurnRequest]], list[list[Sample]]]
"""A round's requests -> for each, its `params.n` samples (as `Generator.generate`)."""


def resubmit(generator: Any) -> GenerateTurn:
    """`generate_turn` for a tidal Generator: each request's whole token ids, one `generate`
    call per round (continuous batching within it)."""

    def generate_turn(requests: list[TurnRequest]) -> list[list[Sample]]:
        return generator.generate([r.token_ids for r in requests], [r.params for r in requests])

    return generate_turn


class FromCache:
    """`generate_turn` that continues each trajectory from its KV-cache row: a first turn is
    `Generator.generate(..., keep=True)`, a later one a `Continuation` with only the new ids
    (the observation), so no conversation is prefilled twice (docs/generate.md,
    "Conversations"). Each trajectory holds a row from its first turn to its end, so a batch's
    trajectories must fit in `max_batch` (`fits`). A trajectory missing from a round has
    ended: its row is freed then; `close()` frees the rest."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator
        self.held: dict[tuple[int, int], Any] = {}  # (group, trajectory) -> Conversation

    @staticmethod
    def fits(generator: Any, trajectories: int) -> bool:
        return trajectories <= generator.config.max_batch

    def __call__(self, requests: list[TurnRequest]) -> list[list[Sample]]:
        from tidal.generate import Continuation

        wanted = {r.key for r in requests}
        for key in [k for k in self.held if k not in wanted]:
            self.generator.release(self.held.pop(key))
        prompts: list[Any] = []
        for r in requests:
            conv = self.held.pop(r.key, None)
            if conv is None:
                prompts.append(r.token_ids)
                continue
            n = len(conv.ids)
            if list(conv.ids) != r.token_ids[:n]:
                raise RuntimeError(
                    f"trajectory {r.key}: the generator's conversation differs from the "
                    "trajectory's ids (a turn was re-tokenized?)"
                )
            prompts.append(Continuation(conv, r.token_ids[n:]))
        outs = self.generator.generate(prompts, [r.params for r in requests], keep=True)
        for r, samples in zip(requests, outs, strict=True):
            group, first = r.key
            for k, s in enumerate(samples):
                if s.conversation is not None and s.conversation.open:
                    self.held[(group, first + k)] = s.conversation
        return outs

    def close(self) -> None:
        for conv in self.held.values():
            self.generator.release(conv)
        self.held.clear()


@dataclass(slots=True)
class _Live:
    """A trajectory in play: its environment copy and the ids its engine has seen."""

    env: Env
    traj: Trajectory
    key: tuple[int, int]
    sent: int = 0  # ids the engine has seen


def run_trajectories(
    env: Env,
    problems: Sequence[Problem],
    codec: TurnCodec,
    generate_turn: GenerateTurn,
    params: Sequence[SamplingParams],
    *,
    max_context: int,
    max_prompt_tokens: int | None = None,
    between_rounds: Callable[[], None] | None = None,
) -> tuple[list[list[Trajectory]], dict[str, Any]]:
    """Play `params[i].n` trajectories of each problem in `env`, round by round.

    Args:
        env: the environment (each trajectory runs on `env.episode()`).
        problems: one per group.
        codec: renders openings and observations to ids.
        generate_turn: the engine (see `resubmit`).
        params: one per problem: its group size `n`, sampling settings, `max_new_tokens` per
            turn and the first turn's seed (turn k of trajectory j is seeded by
            `request_seed(seed, j, k)`; unseeded stays unseeded).
        max_context: the generator's positions per sequence (`Generator.capacity`): a turn is
            given at most what is left, and a conversation with no room left for an
            observation and one more token ends truncated ("context").
        max_prompt_tokens: the longest opening prompt; None: `max_context - 1`.
        between_rounds: called after a round, before the next one's `generate_turn` (the
            async generator switches to the newest policy version there, so a trajectory
            may span versions, each turn's tokens stamped with the version that sampled them).

    Returns:
        One list of trajectories per problem, in order (a group whose `reset` raised has
        trajectories without ids, finish "error"), and the counts: "env_errors" and
        "env_error" (the first message), "context_truncated", "turns", "tool_calls",
        "tool_errors" (sums over the trajectories).

    Raises:
        ValueError: an opening prompt longer than `max_prompt_tokens`, or openings of one
            problem that differ between its trajectories.
    """
    from tidal.rl.experience import request_seed

    limit = max_context - 1 if max_prompt_tokens is None else max_prompt_tokens
    errors: list[str] = []

    def fail(lv: _Live, e: Exception) -> None:
        lv.traj.finish, lv.traj.error = "error", f"{type(e).__name__}: {e}"[:300]
        errors.append(lv.traj.error)

    def room(lv: _Live) -> int:
        return max_context - len(lv.traj.prompt_ids) - len(lv.traj.completion_ids)

    groups: list[list[Trajectory]] = []
    requests: list[TurnRequest] = []
    serves: list[list[_Live]] = []  # the trajectories each request serves
    for i, (problem, p) in enumerate(zip(problems, params, strict=True)):
        lives = [_Live(env.episode(), Trajectory(prompt_ids=[]), (i, j)) for j in range(p.n)]
        groups.append([lv.traj for lv in lives])
        try:
            openings = [lv.env.reset(problem) for lv in lives]
        except Exception as e:  # documented: an environment that raises costs its reward
            fail(lives[0], e)  # counted once for the group
            for lv in lives[1:]:
                lv.traj.finish, lv.traj.error = "error", lives[0].traj.error
            continue
        if any(o != openings[0] for o in openings[1:]):
            raise ValueError(
                f"environment {env.name!r}: reset gave different opening messages for one "
                "problem; a group's first turn is one request, so reset must depend on the "
                "problem only (draw randomness in problem(rng))"
            )
        ids = codec.opening(openings[0])
        if len(ids) > limit:
            raise ValueError(
                f"an opening prompt of environment {env.name!r} is {len(ids)} tokens (tool "
                f"list and template included), over rollout.max_prompt_tokens={limit}: "
                f"{problem.prompt[:80]!r}"
            )
        for lv, msgs in zip(lives, openings, strict=True):
            lv.traj.prompt_ids, lv.traj.messages = list(ids), list(msgs)
        first = lives[0]
        if room(first) < 1:
            for lv in lives:
                lv.traj.finish = "context"
            continue
        n_new = min(p.max_new_tokens, room(first))
        requests.append(
            TurnRequest(first.key, first.traj.token_ids(), 0, replace(p, max_new_tokens=n_new))
        )
        serves.append(lives)

    turn = 0
    while requests:
        outs = generate_turn(requests)
        live: list[_Live] = []
        for req, lives, samples in zip(requests, serves, outs, strict=True):
            for lv, s in zip(lives, samples, strict=True):
                lv.sent = len(req.token_ids)
                if _play(lv, s, turn, codec, room, fail):
                    live.append(lv)
        turn += 1
        requests, serves = [], []
        for lv in live:
            i, j = lv.key
            p = params[i]
            seed = None if p.seed is None else request_seed(p.seed, j, turn)
            n_new = min(p.max_new_tokens, room(lv))
            step_params = replace(p, n=1, seed=seed, max_new_tokens=n_new)
            requests.append(TurnRequest(lv.key, lv.traj.token_ids(), lv.sent, step_params))
            serves.append([lv])
        if requests and between_rounds is not None:
            between_rounds()
    trajs = [t for g in groups for t in g]
    counts = {
        "env_errors": len(errors),
        "env_error": errors[0] if errors else "",
        "context_truncated": sum(t.finish == "context" for t in trajs),
        "turns": sum(t.turns for t in trajs),
        "tool_calls": sum(t.tool_calls for t in trajs),
        "tool_errors": sum(t.tool_errors for t in trajs),
    }
    return groups, counts


def _play(
    lv: _Live,
    s: Sample,
    turn: int,
    codec: TurnCodec,
    room: Callable[[_Live], int],
    fail: Callable[[_Live, Exception], None],
) -> bool:
    """Add one sampled turn to a trajectory and ask its environment what comes back; True if
    it goes on to another turn."""
    t, env = lv.traj, lv.env
    if s.finish_reason == "truncated":  # the engine's row had no position left for the turn
        t.finish = "context"
        return False
    t.add_sampled(s)
    t.turns += 1
    text = s.text or ""
    t.messages.append({"role": "assistant", "content": text})
    try:
        parsed = env.parse(
            text,
            turn,
            last=turn + 1 >= env.max_turns,
            calls_left=env.max_tool_calls - t.tool_calls,
            finish=s.finish_reason,
        )
        step: Step = env.step(parsed)
        t.tool_calls += parsed.n_calls
        t.turn_rewards.append(float(step.reward))
        if step.done or parsed.last:
            t.finish = "done" if step.done else "max_turns"
            t.answer, t.format_ok = step.answer, step.format_ok
            return False
        t.tool_errors += sum(
            m.get("role") == "tool" and str(m.get("content", "")).startswith("Tool error")
            for m in step.messages
        )
        last_id = s.completion_ids[-1] if s.completion_ids else None
        ids = codec.observation(t.messages, step.messages, last_id)
    except Exception as e:  # documented: an environment that raises costs its reward
        fail(lv, e)
        return False
    t.messages += step.messages
    if len(ids) + 1 > room(lv):  # the observation and one more token do not fit
        t.finish = "context"
        return False
    t.add_observation(ids)
    return True


def sample_env_batch(
    policy: Policy,
    env: Env,
    cfg: RLConfig,
    *,
    seeds: tuple[int, ...],
    n_prompts: int,
    generate_turn: GenerateTurn | None = None,
    meta: dict[str, Any] | None = None,
    between_rounds: Callable[[], None] | None = None,
) -> RolloutBatch:
    """`experience.sample_batch` for an environment: the same problems, seeds and sampling
    settings (`cfg.rollout`), each trajectory played to its end; a one-turn `TaskEnv` gives
    the batch `sample_batch` gives for its task. `generate_turn` defaults to
    `default_engine(...)` (FromCache for a multi-turn env). `meta` gains "gen_s",
    "gen_tokens" (sampled), "obs_tokens" and the driver's counts (`run_trajectories`).
    Groups whose `reset` raised are left out (counted in "env_errors"). `between_rounds`
    runs between rounds of turns (`run_trajectories`) for an environment played by tidal's
    driver (one that overrides `Env.play`, as verifiers', is played without it).

    Raises:
        ValueError: an opening prompt over `rollout.max_prompt_tokens`, or a template without
            tool support for an environment with tools.
        RuntimeError: `reset` raised for every problem of the batch.
    """
    from tidal.rl.rollout import RolloutBatch

    codec = env_codec(policy.encoder, env)
    problems, params = _requests(env, cfg, seeds, n_prompts, policy.stop)
    t0 = time.perf_counter()
    if generate_turn is None:
        generate_turn = default_engine(policy.generator, env, sum(p.n for p in params))
    try:
        if between_rounds is not None and type(env).play is Env.play:
            # tidal's driver (what Env.play runs), the weights switching between its rounds
            groups, counts = run_trajectories(
                env,
                problems,
                codec,
                generate_turn,
                params,
                max_context=policy.generator.capacity,
                max_prompt_tokens=policy.max_prompt_tokens,
                between_rounds=between_rounds,
            )
        else:
            groups, counts = env.play(
                problems,
                params,
                policy=policy,
                codec=codec,
                generate_turn=generate_turn,
                max_context=policy.generator.capacity,
                max_prompt_tokens=policy.max_prompt_tokens,
            )
    finally:
        if isinstance(generate_turn, FromCache):
            generate_turn.close()
    kept = [(i, g) for i, g in enumerate(groups) if g and g[0].prompt_ids]
    if not kept:
        raise RuntimeError(
            f"environment {env.name!r}: reset raised for every problem of the batch: "
            f"{counts['env_error']}"
        )
    trajs = [t for _, g in kept for t in g]
    meta = {
        **(meta or {}),
        "gen_s": time.perf_counter() - t0,
        "gen_tokens": sum(sum(t.loss_mask) for t in trajs),
        "obs_tokens": sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs),
        **counts,
        # the loop reports these for tasks: an environment's failures are its grader's
        "grader_errors": counts["env_errors"],
        "grader_error": counts["env_error"],
    }
    return RolloutBatch.from_trajectories(
        trajs,
        task=env.name,
        group_ids=[i for i, g in kept for _ in g],
        pad_id=policy.pad_id,
        meta=meta,
    )


def default_engine(generator: Any, env: Env, trajectories: int) -> GenerateTurn:
    """How a batch of `trajectories` is generated: a multi-turn environment continues each
    from its KV-cache row (`FromCache`) when they all fit in the generator's rows at once, and
    otherwise, like a one-turn task, resubmits whole conversations (`resubmit`)."""
    if env.max_turns > 1 and FromCache.fits(generator, trajectories):
        return FromCache(generator)
    return resubmit(generator)


def _requests(
    env: Env, cfg: RLConfig, seeds: tuple[int, ...], n_prompts: int, stop: tuple[int, ...]
) -> tuple[list[Problem], list[SamplingParams]]:
    """The problems and sampling settings of one batch, as `experience.batch_requests`
    draws them (the same for a `TaskEnv` and its task)."""
    from tidal.rl.experience import request_seed

    r = cfg.rollout
    stream = env.problems("train", seed=request_seed(*seeds))
    problems = [next(stream) for _ in range(n_prompts)]
    params = [
        SamplingParams(
            n=r.group_size,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=stop,
            seed=request_seed(*seeds, i),
        )
        for i in range(n_prompts)
    ]
    return problems, params


def evaluate_env(
    policy: Policy,
    env: Env,
    problems: Sequence[Problem],
    *,
    max_new_tokens: int,
    generate_turn: GenerateTurn | None = None,
    log: Callable[[str], None] | None = None,
    label: str = "eval",
) -> dict[str, Any]:
    """`experience.evaluate` for an environment: one greedy trajectory per held-out problem,
    in chunks of the generator's `max_batch`. "pass1" counts trajectories with reward >= 1;
    also the means of reward, turns and tool calls per trajectory, and the driver's counts
    (summed). A one-turn `TaskEnv` scores what `evaluate` scores."""
    start = time.perf_counter()
    codec = env_codec(policy.encoder, env)
    params = SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=policy.stop
    )
    trajs: list[Trajectory] = []
    totals: dict[str, Any] = {}
    chunk = max(1, policy.generator.config.max_batch)
    for lo in range(0, len(problems), chunk):
        part = problems[lo : lo + chunk]
        engine = generate_turn or default_engine(policy.generator, env, len(part))
        try:
            groups, counts = env.play(
                part,
                [params] * len(part),
                policy=policy,
                codec=codec,
                generate_turn=engine,
                max_context=policy.generator.capacity,
                max_prompt_tokens=policy.max_prompt_tokens,
            )
        finally:
            if isinstance(engine, FromCache):
                engine.close()
        trajs += [g[0] for g in groups]
        for k, v in counts.items():  # sums, and the first error message
            if isinstance(v, str):
                totals[k] = totals.get(k) or v
            else:
                totals[k] = totals.get(k, 0) + v
        if log is not None and lo + len(part) < len(problems):
            right = sum(t.reward >= 1.0 for t in trajs)
            log(f"{label}: {len(trajs)}/{len(problems)} problems, {right} right so far")
    n = max(len(trajs), 1)
    correct = sum(t.reward >= 1.0 for t in trajs)
    return {
        "pass1": correct / n,
        "correct": correct,
        "total": len(trajs),
        "reward_mean": sum(t.reward for t in trajs) / n,
        "turns_mean": sum(t.turns for t in trajs) / n,
        "tool_calls_mean": sum(t.tool_calls for t in trajs) / n,
        **totals,
        "seconds": time.perf_counter() - start,
    }
