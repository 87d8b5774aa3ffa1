"""Save and load a training run with torch.distributed.checkpoint (DCP).

What a checkpoint holds, as DCP keys (one flat dict, so `dcp_to_torch` of a model-only
checkpoint gives a plain model state dict, as with torchtitan):

    <model FQN>                 e.g. layers.0.attention.wq.weight: a tensor or DTensor
    optimizer.state.<FQN>.<k>   AdamW's exp_avg, exp_avg_sq, step (flattened by FQN, so
    optimizer.param_groups...   pipeline stages and every layout reshard)
    lr_scheduler                JSON: the step the schedule started at (the WSD schedule is a
                                function of the step) and its settings
    dataloader                  JSON: the loader's state_dict()
    train_state                 JSON: {"step": N}
    rng.rank<R>.python|torch|cuda   each rank's RNG states

plus tidal.json (model flavor and args, layout, contents) and the COMPLETE marker
(tidal/train/checkpoint/layout.py). Model and optimizer go through DCP's
`get_state_dict`/`set_state_dict`, so a checkpoint saved under FSDP loads into TP, PP or one
process: DCP reads for each rank the pieces of every tensor it holds.

Lifecycle (every rank makes the same calls in the same order): the Trainer calls `plan_load`
first (tidal/train/checkpoint/plan.py: file system only, before the data, the model or any
process group exists), builds one `Checkpointer` after the optimizer, calls `load(plan)` once, then
`maybe_save(step)` after every step, `wait_before_update()` before every optimizer step and
`finish()` at the end, which waits for a background save (`close()` also stops the pinned
mode's writer process). Saves run on a gloo process group of their own, so a background save
never shares a communicator with training.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from tidal.models.transformer import ModelArgs
from tidal.train.checkpoint import checksum, layout, torchtitan
from tidal.train.checkpoint.dcp_io import (
    begin_partial,
    load_flat,
    mismatch_message,
    plain_tensor,
    read_metadata,
    save_flat,
    shape_diff,
)
from tidal.train.checkpoint.layout import CheckpointError
from tidal.train.checkpoint.plan import LoadPlan, arch_diff
from tidal.train.checkpoint.staging import PinnedStaging, copy_to_host
from tidal.train.checkpoint.writer_process import ProcessFileSystemWriter, WriterProcess, available
from tidal.train.config import CHECKPOINT_STATES, CheckpointConfig

Log = Callable[[str], None]
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Stages(nn.Module):
    """One module over several pipeline stages of a rank, with the full model's names (the
    stages hold disjoint parts: layer indices are global, the ends sit on one stage each), so
    DCP's state-dict helpers see one model and one optimizer."""

    def __init__(self, stages: Sequence[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in stages:
            for name, child in stage.named_children():
                if name == "layers":
                    for key, block in child.named_children():
                        self.layers[key] = block
                elif child is not None:
                    self.add_module(name, child)


@dataclass
class SaveStats:
    """Timings of the last save, for logs and benchmarks."""

    step: int = 0
    blocked_s: float = 0.0
    """Seconds the training thread spent in `save()` (with `waited_s`)."""
    waited_s: float = 0.0
    """Of `blocked_s`, seconds spent waiting for the previous save to finish writing (one
    save is in flight at a time: with saves coming faster than the disk writes them, each
    waits for the one before, whatever the mode)."""
    total_s: float = 0.0
    """Seconds from the call until the checkpoint was complete on disk."""
    bytes: int = 0


class Checkpointer:
    """Saves, restores and prunes a run's checkpoints (see the module docstring).

    Args:
        cfg: the checkpoint section.
        folder: the resolved checkpoint folder.
        modules: this rank's model (one module, or its pipeline stages).
        optimizer: the optimizer over all of `modules`.
        loader: the training data loader (its `state_dict()`/`load_state_dict()` are saved
            and restored when it has them); None for a trainer fed batches by its caller.
        device: the training device (pinned staging on CUDA).
        args: the model's architecture (named in mismatch errors).
        info: tidal.json content: {"model": model_info(...), "parallelism": {...}}.
        lr_settings: the schedule's settings, saved for information.
        tokenizer: what a `last_save_in_hf` export copies beside the weights: the path of the
            run's tokenizer.json, or a tokenizer object with `save(path)` (a trained BPE).
        log: rank 0's logger.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        folder: Path,
        modules: Sequence[nn.Module],
        optimizer: torch.optim.Optimizer,
        loader: Any,
        device: torch.device,
        args: ModelArgs,
        info: dict[str, Any],
        lr_settings: dict[str, Any],
        tokenizer: Any = None,
        log: Log = print,
    ):
        self.cfg = cfg
        self.folder = folder
        self.model = modules[0] if len(modules) == 1 else _Stages(modules)
        self.optimizer = optimizer
        self.loader = loader
        self.device = device
        self.args = args
        self.info = info
        self.lr_settings = lr_settings
        self.tokenizer = tokenizer
        self.log = log
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # A gloo group of its own: DCP's collectives of a background save never interleave
        # with training's, and they run on the host whatever the training backend.
        self.pg = dist.new_group(backend="gloo") if cfg.enable and self.world > 1 else None
        pinned = cfg.async_mode == "async_with_pinned_mem"
        # The pinned mode's bytes are written by a child process (writer_process.py), off
        # this process's GIL; where that cannot run (no memfd), by a thread as "async" is.
        self.writer = WriterProcess() if pinned and available() else None
        self.staging = PinnedStaging(device, shared=self.writer is not None) if pinned else None
        self.pending: Future | None = None
        self.last_saved_step: int | None = None
        self.stats = SaveStats()
        self.lr_start = 0
        self.saves_enabled = cfg.enable and not cfg.load_only
        if cfg.enable and loader is not None and not hasattr(loader, "state_dict"):
            log("warning: the data loader has no state_dict(); a resumed run restarts its data")

    # -- what is saved ----------------------------------------------------------------------

    def _flat(self, step: int, *, model_only: bool, only: set[str] | None = None) -> dict:
        """The state as one flat dict of DCP keys; `only` limits the non-model states."""
        keep = set(CHECKPOINT_STATES) if only is None else only
        if model_only or "optimizer" not in keep:
            flat: dict[str, Any] = dict(get_model_state_dict(self.model, options=_OPTIONS))
        else:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
            flat = dict(model_sd)
            flat.update({f"optimizer.{k}": v for k, v in optim_sd.items()})
        flat = {k: plain_tensor(v) for k, v in flat.items()}  # float8 FSDP weights: fp32
        if model_only:
            return flat
        if "lr_scheduler" in keep:
            flat["lr_scheduler"] = json.dumps({"start_step": self.lr_start, **self.lr_settings})
        if "dataloader" in keep and hasattr(self.loader, "state_dict"):
            flat["dataloader"] = json.dumps(self.loader.state_dict())
        if "train_state" in keep:
            flat["train_state"] = json.dumps({"step": step})
        if "rng" in keep:
            flat.update(self._rng_state())
        return flat

    def _rng_state(self) -> dict[str, Any]:
        version, state, gauss = random.getstate()
        prefix = f"rng.rank{self.rank}"
        out: dict[str, Any] = {
            f"{prefix}.python": json.dumps([version, list(state), gauss]),
            f"{prefix}.torch": torch.get_rng_state(),
        }
        if self.device.type == "cuda":
            out[f"{prefix}.cuda"] = torch.cuda.get_rng_state(self.device)
        return out

    def _set_rng_state(self, flat: dict[str, Any]) -> None:
        prefix = f"rng.rank{self.rank}"
        version, state, gauss = json.loads(flat[f"{prefix}.python"])
        random.setstate((version, tuple(state), gauss))
        torch.set_rng_state(flat[f"{prefix}.torch"])
        if f"{prefix}.cuda" in flat:
            torch.cuda.set_rng_state(flat[f"{prefix}.cuda"], self.device)

    def _info(self, step: int, contents: list[str], dtype: str) -> dict[str, Any]:
        return {
            "format": layout.FORMAT,
            "step": step,
            "contents": contents,
            "dtype": dtype,
            "layout": "tidal",  # the weights' order (tidal/train/checkpoint/torchtitan.py)
            **self.info,
            "async_mode": self.cfg.async_mode,
            "torch": torch.__version__,
            "saved_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }

    # -- saving -----------------------------------------------------------------------------

    def maybe_save(self, step: int, total_steps: int) -> None:
        """After step `step`: save on the interval and at the last step."""
        if not self.saves_enabled:
            return
        if step == total_steps:
            self.save(step, last=True)
        elif step % self.cfg.interval == 0:
            self.save(step)

    def save(self, step: int, *, last: bool = False, seed: bool = False) -> None:
        """Save the state after step `step` (at once, or staged and written in the background
        per `async_mode`; the last save always completes before returning). `seed`: the
        model only, in fp32, at once (create_seed_checkpoint)."""
        if not self.saves_enabled:
            return
        start = time.perf_counter()
        previous = self.stats.step
        busy = self.pending is not None and not self.pending.done()
        self.wait()  # one save at a time; raises if the previous one failed
        self.stats = SaveStats(step=step, waited_s=time.perf_counter() - start)
        if busy:
            periodic = not last and step % self.cfg.interval == 0
            hint = "; saves come faster than they are written (checkpoint.interval)"
            hint = hint if periodic else ""
            self.log(
                f"checkpoint: the save of step {step} waited {self.stats.waited_s:.2f}s for "
                f"the save of step {previous} to finish writing{hint}"
            )
        export = last and self.cfg.last_save_model_only
        model_only = export or seed
        flat = self._flat(step, model_only=model_only)
        dtype = "float32"
        if export and self.cfg.export_dtype != "float32":
            dtype = self.cfg.export_dtype
            flat = {
                k: v.to(_DTYPES[dtype]) if v.is_floating_point() else v for k, v in flat.items()
            }
        contents = ["model"] if model_only else self._contents(flat)
        info = self._info(step, contents, dtype)
        mode = "disabled" if last or seed else self.cfg.async_mode
        if mode == "disabled":
            self._write(flat, step, info, start, staged=False)
            self.stats.blocked_s = time.perf_counter() - start
            if last and self.cfg.last_save_in_hf:
                self._export_hf(step)
        else:
            if mode == "async":
                flat = copy_to_host(flat)
            else:
                assert self.staging is not None
                flat = self.staging.stage(flat)
                if self.writer is not None:
                    assert self.staging.segment is not None
                    try:
                        self.writer.start(self.staging.segment)  # at once if already running
                    except BaseException:
                        self.staging.abandon()
                        raise
            self.stats.blocked_s = time.perf_counter() - start
            self.pending = _in_background(self._write, flat, step, info, start, True)
        self.last_saved_step = step

    def _export_hf(self, step: int) -> None:
        """`last_save_in_hf`: rank 0 writes the checkpoint just saved as a Hugging Face folder
        (read back from disk, so any layout works, pipeline stages included); every rank then
        learns whether it succeeded."""
        from tidal.train.checkpoint.hf import export_last_save

        error = None
        if self.rank == 0:
            try:
                export_last_save(
                    layout.step_dir(self.folder, step),
                    self.args,
                    dtype=_DTYPES[self.cfg.export_dtype],
                    tokenizer=self.tokenizer,
                    log=self.log,
                )
            except Exception as e:  # reported on every rank below, not left to hang them
                error = f"{type(e).__name__}: {e}"
        if self.pg is not None:
            box = [error]
            dist.broadcast_object_list(box, src=0, group=self.pg)
            error = box[0]
        if error is not None:
            raise CheckpointError(
                f"checkpoint.last_save_in_hf: exporting step-{step} of {self.folder} failed: "
                f"{error} (the DCP checkpoint itself is complete)"
            )

    def _contents(self, flat: dict[str, Any]) -> list[str]:
        groups = {k.split(".", 1)[0] for k in flat}
        return ["model"] + [s for s in CHECKPOINT_STATES if s in groups]

    def _write(self, flat: dict, step: int, info: dict, start: float, staged: bool) -> None:
        if staged and self.staging is not None:
            if self.staging.cuda:
                self.staging.wait_copied()
            else:
                self.staging.run_host_copy()
        partial = begin_partial(self.folder, step, self.rank, self.pg)
        writer = None
        if staged and self.writer is not None:
            assert self.staging is not None and self.staging.segment is not None
            writer = ProcessFileSystemWriter(
                partial, self.writer, self.staging.segment, hash_pieces=self.cfg.checksums
            )
        save_flat(flat, partial, self.pg, writer)
        final = layout.step_dir(self.folder, step)
        if self.rank == 0:
            sums = checksum.compute(partial) if self.cfg.checksums else None
            layout.commit(partial, final, info, sums)
            self._purge()
            size = sum(f.stat().st_size for f in final.iterdir())
        else:
            size = 0
        total = time.perf_counter() - start
        self.stats = dataclasses.replace(self.stats, total_s=total, bytes=size)
        how = f" ({self.cfg.async_mode}: the step waited {self.stats.blocked_s:.2f}s)"
        how = how if staged else ""
        self.log(f"checkpoint: saved {final} ({size / 2**20:,.1f} MiB) in {total:.2f}s{how}")

    def _purge(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        steps = layout.scan(self.folder).complete
        for step in sorted(steps)[:-k]:
            layout.remove(steps[step])

    def wait_before_update(self) -> None:
        """Call before the optimizer changes weights in place: a pinned staging copy of the
        last save must have read them (on CUDA the device waits, not the host)."""
        if self.staging is not None:
            self.staging.wait_before_update()

    def wait(self) -> None:
        """Block until the background save (if any) is complete on disk.

        Raises:
            CheckpointError: the save failed (its error chained).
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.result()
        except BaseException as e:
            if self.staging is not None:
                self.staging.abandon()
            raise CheckpointError(f"saving a checkpoint in {self.folder} failed: {e}") from e

    def finish(self) -> None:
        """End of training: wait for the last background save."""
        self.wait()

    def close(self) -> None:
        """Wait for the last background save, then stop the writer process and free the
        staging memory (the Checkpointer can still save: both come back on demand)."""
        try:
            self.wait()
        finally:
            if self.writer is not None:
                self.writer.close()
            if self.staging is not None and self.pending is None:
                self.staging.close()

    # -- loading ----------------------------------------------------------------------------

    def load(self, plan: LoadPlan) -> int:
        """Restore what `plan` says; returns the step to continue from (0 for a model-only or
        initial load that keeps no step)."""
        start = time.perf_counter()
        if plan.hf:
            from tidal.models.hf import load_hf_state_dict

            # Every rank reads the slices of its own shards; plan_load has checked the folder's
            # names and shapes against the whole model, so a pipeline stage's subset is fine.
            load_hf_state_dict(plan.path, self.model.state_dict(), strict=False)
            self.log(f"checkpoint: loaded {plan.path} in {time.perf_counter() - start:.2f}s")
            return 0
        only = set() if plan.model_only else set(CHECKPOINT_STATES) - set(self.cfg.excluded)
        flat = self._flat(plan.step, model_only=plan.model_only, only=only)
        metadata = read_metadata(plan.path)
        saved_keys = metadata.state_dict_metadata
        rng_keys = [k for k in flat if k.startswith("rng.")]
        if rng_keys and not all(k in saved_keys for k in rng_keys):
            saved_world = plan.info.get("parallelism", {}).get("world_size", "?")
            self.log(
                f"warning: RNG states not restored: saved by {saved_world} ranks, this run "
                f"has {self.world}"
            )
            for k in rng_keys:
                del flat[k]
        if "dataloader" in flat and "dataloader" not in saved_keys:
            self.log("warning: the checkpoint has no data loader state; the data restarts")
            del flat["dataloader"]
        self._check_fits(plan, flat, metadata)
        hyper = [
            {k: v for k, v in g.items() if k not in ("params", "lr")}
            for g in self.optimizer.param_groups
        ]
        load_flat(flat, plan.path, self.pg, verify=self.cfg.checksums)

        model_sd = {k: v for k, v in flat.items() if not _is_state_key(k)}
        if plan.layout == "torchtitan":  # plan_load allows the model only
            torchtitan.to_tidal_sharded(model_sd, self.args)
        if "optimizer.state" in {k[:15] for k in flat}:
            optim_sd = {
                k[len("optimizer.") :]: v for k, v in flat.items() if k.startswith("optimizer.")
            }
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=model_sd,
                optim_state_dict=optim_sd,
                options=_OPTIONS,
            )
            self._keep_config_hyperparameters(hyper)
        else:
            set_model_state_dict(self.model, model_sd, options=_OPTIONS)
        # The step comes from train_state; without it (excluded, or an initial load of the
        # model) training starts at 0, except a finished run's model-only last checkpoint.
        step = plan.step if plan.resume and plan.model_only else 0
        if "train_state" in flat:
            step = int(json.loads(flat["train_state"])["step"])
        if "lr_scheduler" in flat:
            self.lr_start = int(json.loads(flat["lr_scheduler"])["start_step"])
        elif not plan.model_only:
            self.lr_start = step  # excluded: the schedule restarts over the remaining steps
        if "dataloader" in flat:
            self.loader.load_state_dict(self._fit_loader_state(json.loads(flat["dataloader"])))
        if any(k.startswith("rng.") for k in flat):
            self._set_rng_state(flat)
        saved = plan.info.get("parallelism", {})
        if saved and saved != self.info.get("parallelism"):
            self.log(
                f"checkpoint: resharded from {_layout(saved)} to "
                f"{_layout(self.info['parallelism'])}"
            )
        self.log(f"checkpoint: loaded {plan.path} in {time.perf_counter() - start:.2f}s")
        self.last_saved_step = step if plan.resume else None
        return step

    def _check_fits(self, plan: LoadPlan, flat: dict[str, Any], metadata: Metadata) -> None:
        shapes = {k: tuple(v.shape) for k, v in flat.items() if isinstance(v, torch.Tensor)}
        wrong, missing = shape_diff(shapes, metadata)
        missing += [k for k in flat if k not in shapes and k not in metadata.state_dict_metadata]
        if wrong or missing:
            diff = arch_diff(plan.info.get("model", {}).get("args", {}), self.args)
            raise CheckpointError(mismatch_message(plan.path, wrong, missing, diff))
        # Other dtypes load cast (bf16 optimizer states into an fp32-state run, a bf16 export
        # into fp32 weights): said once per pair, with an example key.
        casts: dict[tuple[torch.dtype, torch.dtype], list[str]] = {}
        for key, value in flat.items():
            md = metadata.state_dict_metadata.get(key)
            if isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata):
                if md.properties.dtype != value.dtype:
                    casts.setdefault((md.properties.dtype, value.dtype), []).append(key)
        for (saved, here), keys in casts.items():
            self.log(
                f"checkpoint: {len(keys)} tensor(s) saved in {str(saved)[6:]} load into "
                f"{str(here)[6:]} here, cast (e.g. {keys[0]})"
            )

    def _keep_config_hyperparameters(self, before: list[dict[str, Any]]) -> None:
        """The config's betas, eps and weight decay win over the checkpoint's (the learning
        rate is set every step)."""
        changed = set()
        for group, want in zip(self.optimizer.param_groups, before, strict=True):
            for k, v in want.items():
                if group.get(k) != v:
                    changed.add(f"{k} {group.get(k)!r} -> {v!r}")
                    group[k] = v
        if changed:
            self.log(
                "checkpoint: optimizer settings from the config replace the checkpoint's: "
                + ", ".join(sorted(changed))
            )

    def _fit_loader_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A PackedLoader position taken with another split of the same global batch (other
        data-parallel degree, per-rank batch size) names the same windows: rewrite the split."""
        loader = self.loader
        keys = ("batch_size", "dp_world")
        if all(k in state for k in keys) and all(hasattr(loader, k) for k in keys):
            saved = (int(state["batch_size"]), int(state["dp_world"]))
            mine = (loader.batch_size, loader.dp_world)
            if saved != mine and saved[0] * saved[1] == mine[0] * mine[1]:
                self.log(
                    f"checkpoint: data position kept across layouts (batch {saved[0]} x "
                    f"{saved[1]} ranks -> {mine[0]} x {mine[1]})"
                )
                state = {**state, "batch_size": mine[0], "dp_world": mine[1]}
        return state


def _in_background(fn: Callable[..., None], *args: Any) -> Future:
    """Run `fn(*args)` on a daemon thread (a process that exits, or is interrupted, does not
    wait for it: an unfinished save stays an incomplete folder)."""
    future: Future = Future()

    def run() -> None:
        try:
            fn(*args)
            future.set_result(None)
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name="tidal-checkpoint", daemon=True).start()
    return future


def _is_state_key(key: str) -> bool:
    return key.split(".", 1)[0] in CHECKPOINT_STATES


def _layout(p: dict[str, Any]) -> str:
    degrees = ", ".join(f"{k}={v}" for k, v in p.get("degrees", {}).items() if v > 1)
    return f"{p.get('world_size', '?')} rank(s) ({degrees or 'single'})"
