"""The RL loop of tidal/rl/grpo.py as processes coupled only through the store (`tidal rl`).

- cli.py: `tidal rl` (every role on this machine) and the role commands `tidal rl trainer`
  (under torchrun for N ranks) and `tidal rl generator --index I`.
- launch.py: the launcher of every role on one machine and the checks made before any starts;
  lifeline.py: a role ends with its launcher.
- trainer.py: the trainer role: publish a version, take the step's rollouts (intake.py), the
  step, log.
- generator.py, async_generator.py: the generator role, sync and async.
- intake.py, schedule.py: which rollouts a trainer step takes, and from which policy versions.
- coupling.py, membership.py: the store keys of a run, heartbeats and bounded waits; the
  generators joining, lost and leaving.
- prefetch.py, generator_ranks.py, mps.py: an async generator's weight prefetch, a generator
  over several ranks, a CUDA MPS daemon for a one-GPU job.

Both roles build their pieces (the task, the trainer, the generator) with tidal/rl/build.py,
as grpo.py does; tests/rl/test_grpo.py checks that the sync loop here and grpo.py give the
same rewards and losses.
"""
