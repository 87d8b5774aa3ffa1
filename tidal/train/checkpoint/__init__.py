"""Distributed checkpoints: save, resume, reshard (DCP), crash-safe on disk.

- `layout.py`: the folder layout, the completion marker, atomic commit and clean-up.
- `staging.py`: host copies of the state for background saves (pinned buffers, side stream).
- `writer_process.py`, `writer_child.py`: the pinned mode's writer process, which writes the
  DCP data files from shared staging memory off the trainer's GIL.
- `plan.py`: `plan_load`, which checkpoint a run starts from, checked before anything is
  built.
- `dcp_io.py`: DCP reads and writes, checks of a state dict against a checkpoint, and
  `save_model`/`load_model` for model-only checkpoints (converters from and to other formats
  reuse them).
- `manager.py`: what a training checkpoint holds and the `Checkpointer` a Trainer drives.
- `hf.py`: Hugging Face folders to and from DCP checkpoints (`tidal convert`, exports).
- `torchtitan.py`: which layout a folder holds (tidal's, torchtitan's, Hugging Face's) and
  torchtitan's model weights to and from tidal's order.

See docs/checkpoint.md.
"""

from tidal.train.checkpoint.dcp_io import load_model, read_metadata, save_model
from tidal.train.checkpoint.layout import CheckpointError
from tidal.train.checkpoint.manager import Checkpointer
from tidal.train.checkpoint.plan import LoadPlan, checkpoint_folder, model_info, plan_load

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
