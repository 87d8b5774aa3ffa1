"""How much a background checkpoint write slows the training loop beside it, on CPU: the old
in-process writer (DCP's FileSystemWriter on a thread of the trainer) against the writer
process (tidal/train/checkpoint/writer_process.py), in one run.

The training loop is a proxy for a GPU step's kernel launches: a main-thread loop of many
small torch ops (Python dispatch, GIL held), timed in blocks. A state dict of `--mb` MB in
`--tensors` tensors is staged once into the pinned mode's host buffers (here plain shared
memory; the device-to-host copy is not what is measured), then saved `--repeats` times per
writer, alternating. Per save: the stall is the wall time of the blocks that ran while the
write was going on, beyond as many blocks at the median speed measured with nothing running
beside them (baseline measured before every save). The loop thread's stall is split with
Linux's schedstat into time waiting for the GIL (blocked: neither on a CPU nor runnable) and
time waiting for a CPU (runnable; another process or the kernel had it). Prints the median and
the spread of both writers' stalls, their GIL and CPU waits, their write times, and the ratio
old / new.

    python benchmarks/checkpoint_stall.py                      # 512 MB, 5 saves per writer
    python benchmarks/checkpoint_stall.py --mb 2048 --repeats 3

On a machine with few cores the writer process competes with the loop for CPU (torch.save's
CRC, the kernel's copy into the page cache) where a thread competes for the GIL too; a
machine with spare cores (the H200 host has 16) shows the GIL's share alone.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

from tidal.train.checkpoint.dcp_io import save_flat
from tidal.train.checkpoint.staging import PinnedStaging
from tidal.train.checkpoint.writer_process import ProcessFileSystemWriter, WriterProcess

BLOCK_OPS = 500


def block(x: torch.Tensor, y: torch.Tensor) -> float:
    """One block of small ops (about a GPU step's launches in miniature); its seconds."""
    start = time.perf_counter()
    for _ in range(BLOCK_OPS):
        x = torch.add(x, y).mul_(0.5)
    return time.perf_counter() - start


def schedstat() -> tuple[float, float]:
    """This thread's seconds on a CPU and seconds runnable but waiting for one (Linux)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, waiting, _ = f.read().split()
    except OSError:
        return 0.0, 0.0
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def baseline(x: torch.Tensor, y: torch.Tensor, n: int = 40) -> float:
    return statistics.median(block(x, y) for _ in range(n))


def one_save(
    kind: str,
    staged: dict,
    staging: PinnedStaging,
    writer: WriterProcess,
    folder: Path,
    x: torch.Tensor,
    y: torch.Tensor,
    pin: tuple[int, int] | None,
) -> dict:
    """Save `staged` in the background with writer `kind` while the loop runs."""
    base = baseline(x, y)
    partial = folder / f"{kind}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    done = threading.Event()
    error: list[BaseException] = []
    seconds = [0.0]

    def write() -> None:
        if pin:
            os.sched_setaffinity(0, {pin[1]})  # this thread only (Linux)
        start = time.perf_counter()
        try:
            if kind == "process":
                assert staging.segment is not None
                sw = ProcessFileSystemWriter(partial, writer, staging.segment)
                save_flat(dict(staged), partial, None, sw)
            else:
                save_flat(dict(staged), partial, None)
        except BaseException as e:
            error.append(e)
        finally:
            seconds[0] = time.perf_counter() - start
            done.set()

    blocks = []
    cpu0, queued0 = schedstat()
    threading.Thread(target=write, daemon=True).start()
    while not done.is_set():
        blocks.append(block(x, y))
    cpu1, queued1 = schedstat()
    if error:
        raise error[0]
    stall = sum(blocks) - len(blocks) * base
    # The loop never sleeps: wall time neither on a CPU nor waiting in the run queue is time
    # blocked on a lock, i.e. waiting for the GIL.
    gil = sum(blocks) - (cpu1 - cpu0) - (queued1 - queued0)
    return {
        "stall_s": stall,
        "write_s": seconds[0],
        "blocks": len(blocks),
        "base_s": base,
        "gil_s": gil,
        "queued_s": queued1 - queued0,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mb", type=int, default=512, help="state dict size")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="saves per writer")
    p.add_argument(
        "--pin",
        action="store_true",
        help="loop on the first allowed CPU, writer (thread or process) on the second: "
        "separates the GIL's share from plain CPU contention on a small machine",
    )
    p.add_argument("--folder", default=None, help="where the saves go (default: a temp dir)")
    args = p.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.set_num_threads(1)
    folder = Path(args.folder or tempfile.mkdtemp(prefix="tidal_stall_"))
    folder.mkdir(parents=True, exist_ok=True)
    numel = args.mb * 2**20 // 4 // args.tensors
    flat = {f"layers.{i}.weight": torch.randn(numel) for i in range(args.tensors)}
    flat["train_state"] = '{"step": 1}'
    staging = PinnedStaging(torch.device("cpu"), shared=True)
    staged = staging.stage(flat)
    staging.run_host_copy()
    writer = WriterProcess()
    assert staging.segment is not None
    writer.start(staging.segment)
    pin = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        assert len(cpus) >= 2, "--pin needs two CPUs"
        pin = (cpus[0], cpus[1])
        os.sched_setaffinity(0, {pin[0]})  # the loop: this (main) thread
        assert writer.pid is not None
        os.sched_setaffinity(writer.pid, {pin[1]})
    x, y = torch.randn(32, 32), torch.randn(32, 32)
    one_save("process", staged, staging, writer, folder, x, y, pin)  # warm: the child's start
    results: dict[str, list[dict]] = {"thread": [], "process": []}
    for r in range(args.repeats):
        for kind in ("thread", "process"):
            res = one_save(kind, staged, staging, writer, folder, x, y, pin)
            results[kind].append(res)
            print(
                f"save {r} {kind:7s} stall {res['stall_s']:6.3f}s over {res['blocks']:4d} "
                f"blocks (block alone {res['base_s'] * 1e3:.2f} ms): waiting for the GIL "
                f"{res['gil_s']:6.3f}s, for a CPU {res['queued_s']:6.3f}s; write "
                f"{res['write_s']:.2f}s",
                flush=True,
            )
    writer.close()
    staging.close()
    if args.folder is None:
        shutil.rmtree(folder, ignore_errors=True)

    def spread(kind: str, key: str) -> tuple[float, str]:
        v = [r[key] for r in results[kind]]
        med = statistics.median(v)
        return med, f"{med:.3f}s (min {min(v):.3f}, max {max(v):.3f})"

    def summary(kind: str) -> tuple[float, float, str]:
        med, stall = spread(kind, "stall_s")
        gil, gil_text = spread(kind, "gil_s")
        text = (
            f"stall {stall}, of it waiting for the GIL {gil_text}, for a CPU "
            f"{spread(kind, 'queued_s')[1]}; write {spread(kind, 'write_s')[1]}"
        )
        return med, gil, text

    old, old_gil, old_text = summary("thread")
    new, new_gil, new_text = summary("process")
    how = f", loop on CPU {pin[0]}, writer on CPU {pin[1]}" if pin else ""
    print(f"\n{args.mb} MB in {args.tensors} tensors, {args.repeats} saves per writer{how}")
    print(f"  thread writer (old):  {old_text}")
    print(f"  writer process (new): {new_text}")
    print(f"  ratio old / new stall: {old / new:.2f}x" if new > 0 else "  new stall <= 0")
    print(f"  GIL wait old {old_gil:.3f}s, new {new_gil:.3f}s (medians)")


if __name__ == "__main__":
    main()
