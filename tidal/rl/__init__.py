"""Reinforcement-learning post-training over the generation engine (tidal/generate): tasks,
rollouts, the loss and the loops that run a trainer and generators.

The engine itself (`Generator`, `SamplingParams`, `logprobs`) is `tidal.generate`.
"""
