"""Triton kernels (GPU; CPU under Triton's interpreter): batch_invariant.py holds the
batch-invariant kernels of the opt-in GPU path of tidal/models/batch_invariant.py."""
