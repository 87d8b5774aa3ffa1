"""Hugging Face checkpoints in and out of tidal.

- `load_hf(path)` / `save_hf(model, path)`: a whole model from / to a folder of config.json
  and safetensors (one file, or shards with model.safetensors.index.json).
- `check_hf(path)`: config, headers, names and shapes checked, no tensor data read.
- `hf_model_args(path)` and `load_hf_state_dict(path, state_dict)`: build a (sharded) model
  from the config, then let every rank read only the slices its DTensor shards hold.
- `save_hf_state_dict(sd, args, path)`: save a full state dict gathered elsewhere.
- `adapter_for(args)`: the family's adapter (`ADAPTERS`): config.json fields and tensor names.
- `gguf_to_hf(gguf, folder)` (tidal/models/hf/from_gguf.py): dequantize a llama.cpp GGUF file into
  such a folder, with tokenizer.json and the chat template; `tidal fetch smollm2-135m` uses it.

One adapter per family maps config.json and tensor names: llama.py (Llama 2, 3, 3.1, 3.2),
qwen2.py (Qwen 2 and 2.5, biases on q/k/v), qwen3.py (Qwen 3 dense) and qwen3_moe.py (Qwen 3
MoE); each states what its family changes of the decoder they share (decoder.py).
`safetensors` (and `gguf` for GGUF files) come with `pip install 'tidal[hf]'`; importing this
package needs neither.
"""

from tidal.models.hf.checkpoint import (
    ADAPTERS,
    adapter_for,
    check_hf,
    hf_model_args,
    load_hf,
    load_hf_state_dict,
    save_hf,
    save_hf_state_dict,
)

__all__ = [
    "ADAPTERS",
    "adapter_for",
    "check_hf",
    "hf_model_args",
    "load_hf",
    "load_hf_state_dict",
    "save_hf",
    "save_hf_state_dict",
]
