"""Generator layouts: a generator role spread over several ranks by tensor parallelism.

Each generator has its own layout (`generator.tp`: one degree for all, or one per generator),
independent of the trainer's and of the other generators'. The store is the only coupling,
so a layout pair needs no common process group: every rank of a generator reads exactly its
own shard of each policy version (`get_state_dict` into its DTensor parameters), whatever
layout the trainer wrote it in.

Lifecycle:
- Before anything starts, `check_generator_layouts(cfg, args)` (in `check_rl_job`, and again
  in each generator rank) refuses a layout that cannot hold the model, naming the
  generator, the degree and the sizes it must divide.
- The local launcher starts generator i with `generator_command`: one process
  (`tidal rl generator --index i ...`) for degree 1, torchrun's launcher with
  `--nproc_per_node tp` for more, as the trainer is started for `--nproc`.
- In every rank of a generator, `join_generator_group` checks that the generator runs on
  as many ranks as its degree, joins the generator's own process group (gloo on CPU, NCCL
  on CUDA) with a timeout and returns its one-dimensional `tp` mesh (None for one rank);
  `shard_model` applies the generation TP plan (no sequence parallel) to the meta-device
  model. Every rank then runs the same loop in lockstep (same prompts, same seeds, so the
  same tokens from the replicated logits); only rank 0 beats, puts rollouts and
  evaluations. In async mode the ranks' Stagers agree on every weight switch
  (tidal/rl/distributed/prefetch.py) and `follow_main` gives every rank rank 0's answer to a
  question asked of the store (is a queue slot free). `leave_generator_group` frees the group at
  the end.
"""

from __future__ import annotations

import math
import sys
from datetime import timedelta
from typing import Any

import torch

from tidal.models.transformer import ModelArgs, Transformer
from tidal.rl.config import RLConfig


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_generator_layouts(
    cfg: RLConfig, args: ModelArgs, *, where: str = "the policy", cuda_devices: int | None = None
) -> None:
    """Every generator's layout holds the model `args`.

    A tensor-parallel degree must divide the query heads, the key/value heads (each rank
    holds whole heads), the MLP hidden width and the vocabulary (the output projection's
    columns), and the model must not tie its embeddings (the embedding is split by rows, the
    output projection by columns). `cuda_devices`: the GPUs a generator rank may use on this
    host; a degree above it is refused. `where` names the model in messages.

    Raises:
        ValueError: naming the generator(s), the degree and the degrees that would fit.
    """
    g = cfg.generator
    by_degree: dict[int, list[int]] = {}
    for i in range(g.count):
        by_degree.setdefault(g.tp_of(i), []).append(i)
    sizes = {
        "query heads": args.n_heads,
        "key/value heads": args.n_kv_heads,
        "MLP hidden width": args.ffn_dim,
        "vocabulary": args.vocab_size,
    }
    fits = _divisors(math.gcd(*sizes.values()))
    for tp, which in sorted(by_degree.items()):
        if tp == 1:
            continue
        plural = "s" if len(which) > 1 else ""
        who = f"generator.tp={tp} (generator{plural} {', '.join(map(str, which))})"
        bad = {name: n for name, n in sizes.items() if n % tp}
        if bad:
            raise ValueError(
                f"{who} cannot hold {where}: a tensor-parallel degree must divide the "
                + ", ".join(f"{name} ({n})" for name, n in sizes.items())
                + f"; {tp} does not divide the {', '.join(bad)}. Degrees that fit: "
                f"{', '.join(map(str, fits))} (at most {fits[-1]} ranks)"
            )
        if args.tie_embeddings:
            raise ValueError(
                f"{who} cannot hold {where}: it ties its embeddings, and tensor parallel "
                "splits the embedding by rows and the output projection by columns; run "
                "this generator on one rank (generator.tp 1)"
            )
        if cuda_devices is not None and tp > cuda_devices:
            raise ValueError(
                f"{who} needs {tp} GPUs, one per rank, but {cuda_devices} are visible here"
            )


def generator_command(cfg: RLConfig, index: int, role_argv: list[str]) -> list[str]:
    """The command that starts generator `index` on this machine with `role_argv` (the
    config's command line and `--store`): one process, or torchrun's launcher for a
    tensor-parallel generator (its own rendezvous on a free port)."""
    tp = cfg.generator.tp_of(index)
    role = ["-m", "tidal", "rl", "generator", "--index", str(index), *role_argv]
    if tp == 1:
        return [sys.executable, *role]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={tp}",
    ]
    return [*torchrun, *role]


def join_generator_group(cfg: RLConfig, index: int, info: Any, device: torch.device) -> Any:
    """In each rank of generator `index` (`info`: its torchrun DistInfo): check that it runs
    on `generator.tp` ranks, join its process group and return its `tp` DeviceMesh (None
    for a generator of one rank). Collectives wait at most `rl.wait_timeout_s`.

    Raises:
        ValueError: the world size is not the generator's degree (the message says how to
            start it).
    """
    tp = cfg.generator.tp_of(index)
    if info.world_size != tp:
        how = (
            "as one process: `tidal rl generator ...`, not under torchrun"
            if tp == 1
            else f"under torchrun: `torchrun --nproc_per_node {tp} -m tidal rl generator ...`"
        )
        raise ValueError(
            f"generator {index} has generator.tp={tp} but runs on {info.world_size} rank(s); "
            f"start it {how}"
        )
    if tp == 1:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=cfg.rl.wait_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))


def leave_generator_group() -> None:
    """Free the generator's process group (a no-op for one rank)."""
    from tidal.parallel.launch import destroy_process_group

    destroy_process_group()


def shard_model(model: Transformer, mesh: Any) -> None:
    """Apply the generation TP plan (replicated activations, no sequence parallel) to a
    meta-device model over `mesh` (a no-op for None)."""
    if mesh is None:
        return
    from tidal.parallel.parallelize import apply_tp

    apply_tp(model, mesh, loss_parallel=False, sequence_parallel=False)


def follow_main(value: int, model: Transformer) -> int:
    """Rank 0's `value` (a bool or a small int), on every rank of a tensor-parallel `model`'s
    mesh (a broadcast: every rank calls it at the same point); `value` itself for a model on
    one rank. The ranks of a generator take each decision that depends on the store (is a
    queue slot free, is the run over) from rank 0, so that they never part ways."""
    mesh = _tp_mesh(model)
    if mesh is None:
        return value
    import torch.distributed as dist

    flag = torch.tensor([int(value)], device=model.rope.device)
    dist.broadcast(flag, group_src=0, group=mesh.get_group())
    return int(flag.item())


def agree_start(first: int, ident: str, model: Transformer) -> tuple[int, str]:
    """Rank 0's first policy version and heartbeat id, on every rank of a tensor-parallel
    `model` (the values themselves on one rank): the ranks read the store at different
    moments, and the trainer's sync announcements name rank 0's id, the one that beats."""
    mesh = _tp_mesh(model)
    if mesh is None:
        return first, ident
    import torch.distributed as dist

    raw = bytes.fromhex(ident)
    values = torch.tensor([first, len(raw), *raw], dtype=torch.long, device=model.rope.device)
    dist.broadcast(values, group_src=0, group=mesh.get_group())
    n = int(values[1])
    return int(values[0]), bytes(int(b) for b in values[2 : 2 + n].tolist()).hex()


def _tp_mesh(model: Transformer) -> Any:
    """The mesh of a tensor-parallel `model`'s parameters, None for a model on one rank."""
    from torch.distributed.tensor import DTensor

    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    return None if mesh is None or mesh.size() == 1 else mesh
