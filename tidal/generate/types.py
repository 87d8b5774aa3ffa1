"""What a Generator is built with, what it returns and what it counts: `GeneratorConfig`,
`Sample`, `Conversation`, `Continuation` and `GeneratorStats` (the engine is
tidal/generate/generator.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

MAX_STOP_IDS = 16
"""Stop token ids per request (a fixed-width device table)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class GeneratorConfig:
    """Sizes and modes of a Generator.

    Example::

        GeneratorConfig(max_batch=64, max_seq_len=1024, batch_invariant=True)
    """

    max_batch: int = 32
    """KV-cache rows: samples decoded at once. Memory: 2 x layers x max_batch x max_seq_len x
    kv heads x head dim elements of the model's dtype."""
    max_seq_len: int | None = None
    """Positions per row (prompt + completion); None: the model's max_seq_len."""
    check_every: int = 8
    """Decode steps between host checks (stop strings, finished rows, refills)."""
    prefill_tokens: int = 16384
    """Most (padded) prompt tokens per prefill forward; larger admissions are split."""
    batch_invariant: bool = False
    """Fixed reduction orders (tidal/models/batch_invariant.py): the reported log-probs are
    bitwise those of `tidal.generate.logprobs(model, ..., batch_invariant=True)`. Slower."""
    compile: bool | None = None
    """torch.compile the decode step and prefill. None: on for CUDA outside batch-invariant
    mode, for models without DTensor parameters (no FSDP or tensor parallel)."""
    cuda_graphs: bool | None = None
    """Capture the decode step in CUDA graphs per (batch bucket, sampler variant), at its
    first use or in `Generator.warm_up`. None: on for CUDA models without DTensor
    parameters."""
    compile_scope: Literal["step", "blocks"] = "step"
    """What `compile` compiles. "step": each decode step whole (every layer, the sampler and
    the row updates in one graph, static shapes) per (batch bucket, sampler variant), and the
    prefill whole with dynamic shapes: the fastest steps, but every compile traces every
    layer, and an RL run meets many buckets (SmolLM2-135M's 30 layers on one H200: over
    280 s of cold compiles). "blocks": one transformer-block function, compiled once for
    every layer, with the batch and time dimensions dynamic from the first call (two graphs
    for the decode steps, batch 1 and the others, and two for the prefill, whatever the
    buckets), plus the sampler and row updates per sampler variant; the embedding, final
    norm and LM head run eagerly, and CUDA graphs still capture the whole step per bucket.
    Compiles cost about one block's worth instead of the whole model's per bucket and
    variant; steps may be a little slower (more kernels, no fusion across blocks). Choose
    "blocks" when compile time counts (many buckets, deep models, short jobs);
    docs/generate.md. `Generator.warm_up` pays for either scope's compiles up front."""
    tune_kernels: bool = False
    """Compile the decode step with inductor's coordinate-descent tuning of each kernel's
    launch configuration (``coordinate_descent_tuning``). On one H200, llama3_1b bf16 at
    batch 1 (benchmarks/generate.py): 1.43 -> 1.29 ms a step. Each compile takes longer,
    which a generator pays once per (batch bucket, sampler variant). Needs ``compile``."""
    amp_dtype: Literal["bf16", "fp16"] | None = None
    """Run under autocast in this dtype (fp32 weights, as a trainer without FSDP does).
    A caller's autocast is honoured as well."""
    fuse_projections: bool = False
    """Compute each attention block's query, key and value projections as one product, and
    each dense MLP's gate and up projections (W1, W3) as another: 2 matmuls per layer where
    there were 5 (and Qwen 2's three q/k/v bias adds as one). The model's parameters are laid
    out once, when the Generator is built, as views into one stacked tensor per module
    (`param.data` is replaced, the Parameter objects and values stay), so in-place weight
    loads update the fused weights with no copy and no extra memory; the model's own forward,
    parameters and state-dict keys are unchanged (tidal/generate/fused.py). Greedy tokens match
    the unfused ones; log-probs may differ in the last bits (a GEMM may tile a wider product
    differently). Mixture-of-experts layers and projections that are not plain `nn.Linear`
    layers (float8) are left unfused. Off by default until its decode-step gain is measured on a
    GPU (benchmarks/generate.py --fuse-projections). True with `batch_invariant` (the stacked
    product changes its fixed reduction blocks) or DTensor parameters (tensor parallel, FSDP)
    is refused."""
    record_routing: bool = False
    """Mixture-of-experts models: record the experts every MoE layer routed each token to
    (`Sample.routed_experts`, for routing replay in RL). Costs max_batch x MoE layers x
    max_seq_len x top_k bytes of device memory (uint8 ids; int16 past 256 experts); a dense
    model is refused."""

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"GeneratorConfig.max_batch must be >= 1, got {self.max_batch}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"GeneratorConfig.max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.check_every < 1:
            raise ValueError(f"GeneratorConfig.check_every must be >= 1, got {self.check_every}")
        if self.prefill_tokens < 1:
            raise ValueError(
                f"GeneratorConfig.prefill_tokens must be >= 1, got {self.prefill_tokens}"
            )
        if self.compile_scope not in ("step", "blocks"):
            raise ValueError(
                "GeneratorConfig.compile_scope must be 'step' or 'blocks', got "
                f"{self.compile_scope!r}"
            )
        if self.amp_dtype not in (None, "bf16", "fp16"):
            raise ValueError(
                f"GeneratorConfig.amp_dtype must be None, 'bf16' or 'fp16', got {self.amp_dtype!r}"
            )


@dataclass(slots=True)
class Sample:
    """One completion of one prompt."""

    prompt_index: int
    """Position of the prompt in the `generate` call."""
    sample_index: int
    """Index in the prompt's group (0..n-1)."""
    prompt_ids: list[int]
    completion_ids: list[int]
    """Generated tokens; ends with the stop token when one was hit."""
    text: str | None
    """Decoded completion (special tokens dropped, cut before a stop string); None without a
    tokenizer."""
    finish_reason: Literal["stop", "length", "truncated"]
    """"stop": a stop token or string; "length": max_new_tokens reached (or the row's last
    position, for a continuation); "truncated": a continuation whose tokens leave no room in
    the row for a new one (no completion; its conversation is closed)."""
    logprobs: list[float]
    """Per completion token: log-prob under the model (temperature 1, no truncation)."""
    sampling_logprobs: list[float]
    """Per completion token: log-prob under the distribution sampled (after temperature and
    truncation); 0 for greedy decoding."""
    weight_version: int | None
    """`Generator.version` when the sample's first token was generated (None: unversioned
    weights); the oldest version in `versions`."""
    versions: list[int] | None = None
    """Per completion token: the policy version that produced it (weights swapped in flight
    through `Generator.swap_hook` change it mid-sequence; -1 for unversioned weights). None:
    every token is `weight_version`'s."""
    conversation: Conversation | None = None
    """The conversation this turn belongs to (a request made with `keep=True`, or a
    `Continuation`): continue it while it is open. None otherwise."""
    routed_experts: Any = None
    """With `GeneratorConfig.record_routing`: the experts each MoE layer routed every token
    the model ran to, a CPU tensor [MoE layers, len(prompt_ids) + len(completion_ids) - 1,
    top_k] (uint8, int16 past 256 experts): the prompt's tokens and every completion token
    but the last (never fed back), in top-k order, i.e. the trainer's input positions. None
    otherwise."""

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_index": self.prompt_index,
            "sample_index": self.sample_index,
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "logprobs": self.logprobs,
            "sampling_logprobs": self.sampling_logprobs,
            "weight_version": self.weight_version,
            "versions": self.versions,
        }


@dataclass(eq=False, slots=True)
class Conversation:
    """A sample's KV-cache row, kept after its turn so that the sequence continues from the
    cache: `Sample.conversation` of a request made with `keep=True`. Hand it back in a
    `Continuation` (or to `Generator.continue_`) to append an observation and sample the next
    turn, prefilling only the new tokens; `Generator.release` frees its row. The Generator
    updates it: read it, never write it.

    Example::

        (s,) = gen.generate([prompt], SamplingParams(max_new_tokens=64), keep=True)[0]
        (t,) = gen.continue_([s.conversation], [tool_result_ids])
        gen.release(t.conversation)
    """

    ids: list[int]
    """Every token so far: the prompt, each turn's completion and each observation; the last
    turn's tokens last."""
    sample_index: int
    """Index of its first turn's sample in that request's group (its random keys derive from
    it, each turn's seed and the turn)."""
    turns: int = 0
    """Turns generated so far."""
    open: bool = True
    """Whether it holds a cache row: False once released, ended as truncated, or finished
    by a continuation made with `keep=False`."""


@dataclass(frozen=True, slots=True)
class Continuation:
    """A prompt that continues a conversation from its cache row: `tokens` (an observation:
    a tool result, an environment or user message, as token ids) are appended to
    `conversation.ids`, only they (and the last turn's final token, not yet in the cache) are
    prefilled, and the next turn is sampled after them. Give it to `Generator.generate` or
    `stream` among plain prompts; its `SamplingParams` must have n=1."""

    conversation: Conversation
    tokens: Sequence[int] = field(default=())


@dataclass(slots=True)
class GeneratorStats:
    """Counters since the Generator was built (tests and benchmarks read them)."""

    prefill_calls: int = 0
    prefill_tokens: int = 0
    """Prompt tokens run through the model (each prompt once, however many samples; of a
    continuation, only the tokens its row does not hold)."""
    decode_steps: int = 0
    host_checks: int = 0
    graphs_captured: int = 0
    weight_swaps: int = 0
    """Versions swapped in between decode steps by `Generator.swap_hook`."""
    decode_seconds: float = 0.0
    """Host time spent in decode steps and checks (device-synchronized at each check)."""
    truncated: int = 0
    """Continuations that ended as truncated (their tokens did not fit in the row)."""
    warmup_seconds: float = 0.0
    """Time spent in `Generator.warm_up` (its compiles and captures)."""
