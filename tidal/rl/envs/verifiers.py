"""A `verifiers` environment (https://github.com/PrimeIntellect-ai/verifiers, 0.4.0) trained on
by tidal: verifiers plays each episode with its own program against tidal's OpenAI-compatible
server, and the trainer gets the exact tokens the server sampled.

    tidal rl --config NAME --task.name verifiers \\
        --task.params '{"taskset": "my-taskset", "taskset_args": {"num_tasks": 50}}'

Lifecycle of one batch (`VerifiersEnv.play`, in the process that owns the generator):

1. tidal/serve's app is started on the policy's `Generator` (a fresh `Engine`) with uvicorn on
   a free 127.0.0.1 port, in a thread.
2. verifiers' `Env` (loaded from the taskset id as `vf-eval ID` loads it: the taskset's own
   `Env`, else `SingleAgentEnv`) runs `group_size` episodes of each problem's task inside
   `Env.serving()`: its interception server, its harness program (by default `null`, its
   plain chat loop, run by uv in the `subprocess` runtime), its `EvalClient` relaying each
   model call to tidal's server with the rollout's sampling settings and
   `"return_token_ids": true`, then the task's `@reward`s.
3. The server's `record` hook keeps every response by the request's `X-Session-ID` header,
   which verifiers' client sets to the trace id. A trajectory is its trace's responses in
   order: the first prompt's ids, each turn's sampled ids (trained on, with their log-probs
   and policy versions) and, between turns, the ids the next prompt adds (the tool results
   or user turn, masked out). Its reward is the trace's (verifiers' weighted sum).
4. The server stops (its engine with it) before the trainer touches the weights.

Token-exactness: the server continues each session from its own ids (`Served.sessions`): a
turn that sends back the reply and new messages is prompted with the earlier prompt and
sampled ids and only the new messages' ids, so a later turn's prompt ids begin with the
earlier turns' ids. When they do not (the harness rewrote the history, compacted it, or
changed tools), the trajectory ends at the last turn that chains, counted in the batch's
`meta["retokenized"]`: nothing re-tokenized is ever trained on.

An episode that fails (the harness exits, a model call is refused, a reward raises) is a
trajectory with reward 0 and no sampled tokens, counted in `meta["env_errors"]` with the
first message; the run goes on.

verifiers is imported only when a `VerifiersEnv` is used; without it the error names the
install command (`pip install 'tidal[verifiers]'`). Its default harness needs `uv` on PATH.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidal.generate import Sample, SamplingParams
from tidal.rl.envs.base import Env, Messages, Step, Turn, register_env
from tidal.rl.envs.trajectory import Trajectory
from tidal.rl.tasks.base import Problem

if TYPE_CHECKING:
    from tidal.rl.envs.trajectory import GenerateTurn, TurnCodec
    from tidal.rl.experience import Policy

INSTALL = "pip install 'tidal[verifiers]'"
"""The install command named when verifiers is missing (the extra pins verifiers==0.4.0)."""

SESSION_HEADER = "x-session-id"
"""The header verifiers' client sends on every model call of a rollout: its trace id."""

SESSIONS = 16384
"""Chat sessions the in-process server continues from their exact ids (`Served.sessions`)."""


def import_verifiers() -> Any:
    """`verifiers.v1`, or an ImportError naming the install command."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(
            f"the 'verifiers' environment needs the verifiers package ({e.name} is missing): "
            f"{INSTALL}"
        ) from e
    return vf


@register_env("verifiers")
@dataclass(kw_only=True)
class VerifiersEnv(Env):
    """A verifiers taskset (and its `Env`, harness and rewards) as a tidal environment. Its
    problems are the taskset's tasks; verifiers plays the episodes through tidal's server
    (module docstring). `max_turns` and `max_tool_calls` are verifiers' to enforce (its
    agent config, `agent_args`), not tidal's."""

    taskset: str
    """The verifiers taskset id: an importable package exporting its `Taskset` subclass in
    `__all__`, as `vf-eval ID` takes it (a built-in one, e.g. `textarena`, or your own)."""
    taskset_args: dict[str, Any] = field(default_factory=dict)
    """The taskset's config fields (what `--env.taskset.*` sets on `vf-eval`)."""
    env_id: str = ""
    """A verifiers `Env` to pair with the taskset (`--env.id`); empty: the taskset's own,
    else `SingleAgentEnv`."""
    env_args: dict[str, Any] = field(default_factory=dict)
    """The env's own config fields (`--env.*`, e.g. user-sim's `persona`)."""
    harness: str = "null"
    """The harness playing the agent seat (`--env.agent.harness.id`): `null` is verifiers'
    plain chat loop (tool calls through MCP), run by uv."""
    runtime: str = "subprocess"
    """Where the harness program runs (`--env.agent.runtime.type`); `subprocess`: on this
    machine."""
    agent_args: dict[str, Any] = field(default_factory=dict)
    """More fields of every seat's agent config (`--env.agent.*`, e.g. `{"max_turns": 4}`)."""
    seats: dict[str, dict[str, Any]] = field(default_factory=lambda: {"agent": {}})
    """The env's agent seats and each one's own config fields: `agent` for
    `SingleAgentEnv`; a multi-agent env names its own (`user-sim`: `assistant` and `user`).
    Only trainable seats' traces are trained on."""
    max_tasks: int = 100_000
    """Tasks read from an endless taskset."""
    max_concurrent: int = 64
    """Episodes in flight at once."""
    start_timeout_s: float = 60.0
    """How long the in-process server may take to start."""

    _vf_env: Any = field(default=None, init=False, repr=False)
    _tasks: list[Any] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.taskset:
            raise ValueError("verifiers environment: taskset must name a verifiers taskset id")
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")

    # -- verifiers' side ------------------------------------------------------------------

    def vf_env(self) -> Any:
        """The verifiers `Env` (built once, as `vf-eval` builds it from its flags)."""
        if self._vf_env is None:
            import_verifiers()
            from verifiers.v1.configs.cli.eval import EvalConfig
            from verifiers.v1.utils.loaders import load_environment

            env_cfg: dict[str, Any] = {
                **self.env_args,
                "taskset": {"id": self.taskset, **self.taskset_args},
            }
            for seat, own in self.seats.items():
                env_cfg[seat] = {
                    "harness": {"id": self.harness},
                    "runtime": {"type": self.runtime},
                    **self.agent_args,
                    **own,
                }
            if self.env_id:
                env_cfg["id"] = self.env_id
            self._vf_env = load_environment(EvalConfig.model_validate({"env": env_cfg}).env)
        return self._vf_env

    def tasks(self) -> list[Any]:
        """The taskset's tasks (at most `max_tasks` of an endless one)."""
        if self._tasks is None:
            it = iter(self.vf_env().taskset)
            self._tasks = [t for _, t in zip(range(self.max_tasks), it, strict=False)]
            if not self._tasks:
                raise ValueError(f"verifiers taskset {self.taskset!r} has no tasks")
        return self._tasks

    # -- tidal's Env API -------------------------------------------------------------------

    def problem(self, rng: random.Random) -> Problem:
        tasks = self.tasks()
        i = rng.randrange(len(tasks))
        return Problem(_prompt_text(tasks[i].data.prompt), i)

    def key(self, problem: Problem) -> str:
        return f"{problem.reference}:{problem.prompt}"

    def reset(self, problem: Problem) -> Messages:
        """The task's opening (its system prompt and prompt): what tidal checks against the
        tokenizer and `rollout.max_prompt_tokens`; the harness sends its own."""
        self.reference = problem.reference
        data = self.tasks()[problem.reference].data
        out: Messages = (
            [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        )
        if isinstance(data.prompt, str) or data.prompt is None:
            return [*out, {"role": "user", "content": data.prompt or ""}]
        return [*out, *({"role": m.role, "content": _prompt_text([m])} for m in data.prompt)]

    def step(self, turn: Turn) -> Step:
        raise RuntimeError(
            "a verifiers environment is played by verifiers through the server (play), "
            "not turn by turn"
        )

    def play(
        self,
        problems: Sequence[Problem],
        params: Sequence[SamplingParams],
        *,
        policy: Policy,
        codec: TurnCodec,
        generate_turn: GenerateTurn,
        max_context: int,
        max_prompt_tokens: int | None,
    ) -> tuple[list[list[Trajectory]], dict[str, Any]]:
        """Play the episodes through an in-process server on `policy.generator` (module
        docstring); `generate_turn` is not used: the server's engine batches the calls."""
        if self.harness == "null" and self.runtime == "subprocess" and not shutil.which("uv"):
            raise RuntimeError(
                "verifiers' null harness runs its chat program with uv, which is not on PATH: "
                "pip install uv"
            )
        recorded: dict[str, list[dict[str, Any]]] = defaultdict(list)

        def record(headers: Mapping[str, str], body: dict[str, Any]) -> None:
            session = headers.get(SESSION_HEADER)
            if session is not None:
                recorded[session].append(body)

        served = _served(policy, codec)
        with _serving(served, record, self.start_timeout_s) as url:
            episodes = asyncio.run(self._episodes(url, served.name, problems, params))
        groups: list[list[Trajectory]] = []
        counts: dict[str, Any] = {"env_errors": 0, "env_error": "", "retokenized": 0}
        for problem, group in zip(problems, episodes, strict=True):
            opening = codec.opening(self.reset(problem))
            groups.append([self._trajectory(ep, recorded, opening, counts) for ep in group])
        trajs = [t for g in groups for t in g]
        counts.update(
            context_truncated=0,
            turns=sum(t.turns for t in trajs),
            tool_calls=sum(t.tool_calls for t in trajs),
            tool_errors=0,
        )
        return groups, counts

    async def _episodes(
        self, url: str, model: str, problems: Sequence[Problem], params: Sequence[SamplingParams]
    ) -> list[list[Any]]:
        """verifiers' episodes, `params[i].n` of each problem's task, in one `serving()`."""
        from verifiers.v1 import EvalClientConfig, ModelContext, SamplingConfig
        from verifiers.v1.env import RunSlot

        env, tasks = self.vf_env(), self.tasks()
        client = EvalClientConfig(base_url=url, api_key_var="TIDAL_SERVE_API_KEY")
        limit = asyncio.Semaphore(self.max_concurrent)
        async with env.serving():
            runs = []
            for problem, p in zip(problems, params, strict=True):
                for j in range(p.n):
                    sampling: dict[str, Any] = {
                        "temperature": p.temperature,
                        "top_p": p.top_p,
                        "max_tokens": p.max_new_tokens,
                        "return_token_ids": True,
                    }
                    if p.top_k:
                        sampling["top_k"] = p.top_k
                    if p.seed is not None:
                        sampling["seed"] = (p.seed + j) % (1 << 63)
                    ctx = ModelContext(
                        model=model, client=client, sampling=SamplingConfig(**sampling)
                    )
                    runs.append(env.run_slot(RunSlot(tasks[problem.reference]), ctx, limit))
            done = await asyncio.gather(*runs)
        out, at = [], 0
        for p in params:
            out.append(list(done[at : at + p.n]))
            at += p.n
        return out

    def _trajectory(
        self,
        episode: Any,
        recorded: Mapping[str, list[dict[str, Any]]],
        opening: list[int],
        counts: dict[str, Any],
    ) -> Trajectory:
        """The token-exact trajectory of an episode's trainable trace (module docstring)."""
        traces = [t for t in episode.traces if t.agent.trainable] or list(episode.traces)
        trace = traces[0] if traces else None
        calls = recorded.get(trace.id, []) if trace is not None else []
        t = Trajectory(prompt_ids=list(calls[0]["prompt_token_ids"]) if calls else opening)
        error = _episode_error(episode, trace)
        if error or not calls:
            stop = getattr(trace, "stop_condition", None)
            error = error or f"the episode made no model call (its trace stopped: {stop})"
            t.finish, t.error = "error", error[:300]
            counts["env_errors"] += 1
            counts["env_error"] = counts["env_error"] or t.error
            return t
        assert trace is not None  # an episode without a trace is an error above
        for k, body in enumerate(calls):
            prompt = body["prompt_token_ids"]
            if k:
                have = t.token_ids()
                if prompt[: len(have)] != have:
                    counts["retokenized"] += 1
                    break
                t.add_observation(prompt[len(have) :])
            choice = body["choices"][0]
            t.add_sampled(_sample(prompt, choice))
            t.turns += 1
            t.tool_calls += len(choice["message"].get("tool_calls") or [])
        t.messages = [m.model_dump(exclude_none=True) for m in trace.messages]
        t.turn_rewards = [float(trace.reward)]
        t.answer, t.format_ok = trace.last_reply, True
        t.finish = "done"
        return t


def _sample(prompt: list[int], choice: dict[str, Any]) -> Sample:
    """A response choice of the server's token-id extension as the generator's Sample."""
    reason = choice["finish_reason"]
    return Sample(
        prompt_index=0,
        sample_index=choice["index"],
        prompt_ids=prompt,
        completion_ids=choice["token_ids"],
        text=choice["message"].get("content") or "",
        finish_reason="length" if reason == "length" else "stop",
        logprobs=choice["token_logprobs"],
        sampling_logprobs=choice["sampling_logprobs"],
        weight_version=None,
        versions=choice["policy_versions"],
    )


def _episode_error(episode: Any, trace: Any) -> str:
    """The episode's failure: its own error, else one of its traces' (any seat's: a user
    simulator's failed call ends the trained seat's exchange too), else a reward not run."""
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if errors:
        e = errors[-1]
        return f"{e.type}: {e.message}"
    if trace is None:
        return "the episode has no trace"
    if any(r is None for r in trace.rewards.values()):
        return "a reward of the task did not run"
    return ""


def _prompt_text(prompt: Any) -> str:
    """A task prompt (a string or messages) as one string, for tidal's problem key and logs."""
    if prompt is None or isinstance(prompt, str):
        return prompt or ""
    parts = []
    for m in prompt:
        content = getattr(m, "content", None)
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [getattr(c, "text", "") or "" for c in content]
    return "\n".join(parts)


def _served(policy: Policy, codec: TurnCodec) -> Any:
    """tidal/serve's `Served` on the policy's generator: its chat template and stop ids."""
    from tidal.serve.api import Served
    from tidal.serve.chat import ChatFormat
    from tidal.serve.engine import Engine

    tok = codec.encoder.tokenizer
    return Served(
        "tidal-policy",
        Engine(policy.generator),
        lambda text: [tok.bos_id, *tok.encode(text)],
        ChatFormat(codec.encoder, tuple(policy.stop)),
        sessions=SESSIONS,
    )


@contextlib.contextmanager
def _serving(served: Any, record: Any, timeout: float) -> Iterator[str]:
    """tidal/serve's app with `record` on a free 127.0.0.1 port, for the block."""
    try:
        from tidal.serve.app import create_app, serve_in_thread
    except ImportError as e:
        raise ImportError(
            "the 'verifiers' environment serves the policy with tidal serve, which needs "
            "FastAPI and uvicorn: pip install 'tidal[serve]'"
        ) from e
    with serve_in_thread(create_app(served, record=record), timeout=timeout) as url:
        yield url
