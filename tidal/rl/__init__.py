"""Reinforcement-learning post-training: generation with the training model's own code.

    from tidal.rl import Generator, GeneratorConfig, SamplingParams, logprobs

- `Generator` (tidal/rl/generate.py): batched sampling over a static KV cache with per-row
  lengths, prefill once per group, continuous batching, no host sync per token, CUDA graphs.
- `SamplingParams`, `sample`, `logprobs` (tidal/rl/sampling.py): per-request sampling and
  the trainer-side scoring of sequences through the training forward.
- Batch-invariant mode (`GeneratorConfig(batch_invariant=True)`, `logprobs(...,
  batch_invariant=True)`): bitwise-equal generator and trainer log-probs
  (tidal/models/batch_invariant.py).
"""

from tidal.rl.generate import Generator, GeneratorConfig, GeneratorStats, Sample
from tidal.rl.sampling import SamplingParams, completion_logprobs, logprobs, sample

__all__ = [
    "Generator",
    "GeneratorConfig",
    "GeneratorStats",
    "Sample",
    "SamplingParams",
    "completion_logprobs",
    "logprobs",
    "sample",
]
