"""The generation engine: batched sampling with the training model's own module code.

    from tidal.generate import Generator, GeneratorConfig, SamplingParams, logprobs

- `Generator` (generator.py): batched sampling over a static KV cache with per-row lengths,
  prefill once per group, continuous batching, no host sync per token, compiled steps and
  CUDA graphs (the device side: steps.py), `warm_up` to pay for compiles before the first
  call, conversations continued from their cache rows; weights loaded in place (weights.py)
  from a state dict or a tidal store.
- `GeneratorConfig`, `Sample`, `GeneratorStats` (types.py): what a Generator is built with,
  returns and counts; `Conversation`, `Continuation` (types.py): a sample's cache row kept
  between turns, and the prompt that continues it (multi-turn rollouts).
- `SamplingParams`, `sample` (sampler.py): per-request sampling parameters and the batched,
  host-sync-free sampler.
- `logprobs`, `completion_logprobs` (scoring.py): the trainer-side scoring of sequences
  through the training forward.
- Batch-invariant mode (`GeneratorConfig(batch_invariant=True)`, `logprobs(...,
  batch_invariant=True)`): bitwise-equal generator and trainer log-probs
  (tidal/models/batch_invariant.py).
- `tidal generate` (cli.py): the command line.

The package imports only torch and tidal.models (the command line adds tidal.train's configs,
tokenizer and checkpoint reader); tests/generate/test_layering.py checks it.
"""

from tidal.generate.generator import Generator
from tidal.generate.sampler import SamplingParams, sample
from tidal.generate.scoring import completion_logprobs, logprobs
from tidal.generate.types import (
    Continuation,
    Conversation,
    GeneratorConfig,
    GeneratorStats,
    Sample,
)

__all__ = [
    "Continuation",
    "Conversation",
    "Generator",
    "GeneratorConfig",
    "GeneratorStats",
    "Sample",
    "SamplingParams",
    "completion_logprobs",
    "logprobs",
    "sample",
]
