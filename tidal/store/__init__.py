"""tidal.store: a sharding-aware distributed tensor store for weight sync.

Put tensors, DTensors and whole state dicts by key and version from any process and layout;
get them back in any other layout, reading only the bytes each destination shard needs.
See docs/store.md.

Example::

    import torch, tidal.store
    store = tidal.store.connect()          # embedded store, no set-up
    store.put("w", torch.arange(6.).view(2, 3))
    assert store.get("w").sum() == 15
"""

from tidal.store.client import Store, connect
from tidal.store.errors import (
    AuthError,
    KeyNotFoundError,
    ProtocolError,
    StoreError,
    VersionNotFoundError,
    VolumeLostError,
    WaitExpiredError,
)
from tidal.store.transports.cuda.ipc import warm_up as warm_up_cuda

__all__ = [
    "AuthError",
    "KeyNotFoundError",
    "ProtocolError",
    "Store",
    "StoreError",
    "VersionNotFoundError",
    "VolumeLostError",
    "WaitExpiredError",
    "connect",
    "warm_up_cuda",
]
