"""Distributed checkpoints: save, resume, reshard (DCP), crash-safe on disk.

- `layout.py`: the folder layout, the completion marker, atomic commit and clean-up.
- `staging.py`: host copies of the state for background saves (pinned buffers, side stream).
- `manager.py`: what a checkpoint holds, `plan_load` (which checkpoint, checked before
  anything is built), the `Checkpointer` a Trainer drives, and `save_model`/`load_model` for
  model-only checkpoints (weights in and out of other formats reuse them).

See docs/checkpoint.md.
"""

from tidal.train.checkpoint.layout import CheckpointError
from tidal.train.checkpoint.manager import (
    Checkpointer,
    LoadPlan,
    checkpoint_folder,
    load_model,
    model_info,
    plan_load,
    read_metadata,
    save_model,
)

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "LoadPlan",
    "checkpoint_folder",
    "load_model",
    "model_info",
    "plan_load",
    "read_metadata",
    "save_model",
]
