"""Model definitions: the math only, no parallelism."""

from tidal.models.flavors import FLAVORS, get_flavor
from tidal.models.hf import load_hf, save_hf
from tidal.models.kv_cache import KVCache, LayerCache
from tidal.models.moe import MoEArgs
from tidal.models.transformer import ModelArgs, RopeScaling, Transformer

__all__ = [
    "FLAVORS",
    "KVCache",
    "LayerCache",
    "ModelArgs",
    "MoEArgs",
    "RopeScaling",
    "Transformer",
    "get_flavor",
    "load_hf",
    "save_hf",
]
