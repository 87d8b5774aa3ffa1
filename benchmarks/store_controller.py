"""The store controller's own cost per op, in one process (no sockets, no copies): put_begin,
put_commit, acquire and release of a state dict of N tensors (default 114) into a device
volume, 400 rounds, medians of the last 380.

    python benchmarks/store_controller.py [N]
"""

import statistics
import sys
import time

from tidal.store.controller import Controller

N = int(sys.argv[1]) if len(sys.argv) > 1 else 114
c = Controller("s1", keep=1)
w = c.writes  # the put lifecycle is the controller's writes part
W, R = 1, 2
w.device_volume(W, volume_id="cuda.1.x", host="h")
decl = [
    {"name": [f"layers.{i}.w"], "shape": [16], "dtype": "bfloat16", "offsets": [0], "sizes": [16]}
    for i in range(N)
]
plan = w.put_declare(
    W, key="p", kind="state_dict", writers=1, keep=None, host="h", volume="cuda.1.x", tensors=decl
)["plan"]
res = None
sig = None


def handles(slots: list[int]) -> list[dict]:
    """put_handles' records for new slots (fake IPC handles: nothing opens them here)."""
    return [{"slot": s, "uuid": "u", "handle": b"x" * 64, "event": b"e" * 64} for s in slots]


tb, tc, ta, tr = [], [], [], []
for v in range(400):
    t0 = time.perf_counter()
    b = w.put_begin(
        W,
        key="p",
        plan=plan,
        version=v,
        writer="w",
        reservation=res["id"] if res else None,
        objects=[],
    )
    t1 = time.perf_counter()
    if b["fresh"]:
        w.put_handles(
            W,
            volume_id="cuda.1.x",
            handles=handles(b["fresh"]),
        )
    t2 = time.perf_counter()
    d = w.put_commit(W, key="p", version=v, writer="w", reserve=v >= 1)
    t3 = time.perf_counter()
    res = d["next"]
    if res and res["fresh"]:
        w.put_handles(
            W,
            volume_id="cuda.1.x",
            handles=handles(res["fresh"]),
        )
    t4 = time.perf_counter()
    a = c.acquire(R, key="p", version=v, known_sig=sig, wait_ms=None)
    sig = a["sig"]
    t5 = time.perf_counter()
    c.release(R, lease=a["lease"])
    t6 = time.perf_counter()
    tb.append(t1 - t0)
    tc.append(t3 - t2)
    ta.append(t5 - t4)
    tr.append(t6 - t5)


def us(x: list[float]) -> str:
    return f"{statistics.median(x[20:]) * 1e6:.0f} us"


print(f"N={N}: begin {us(tb)}, commit {us(tc)}, acquire {us(ta)}, release {us(tr)}")
