"""The debugging tools of a run: the profiler trace of chosen steps, CUDA memory snapshots
(a stand-in allocator module on CPU, the real one under the gpu marker), and the Flight
Recorder environment set before a process group starts."""

import io
import json
import os
import pickle
import sys
import types
from pathlib import Path

import pytest
import torch

from tidal.parallel.launch import enable_flight_recorder
from tidal.train.config import DebugConfig, ProfilerConfig
from tidal.train.profiling import RunProfiler, setup_flight_recorder, step_action

from .test_trainer import tiny_trainer


def _spans(trace: Path, prefix: str) -> list[str]:
    """Names of the spans in a Chrome trace that start with `prefix`."""
    events = json.loads(trace.read_text())["traceEvents"]
    return sorted(e["name"] for e in events if str(e.get("name", "")).startswith(prefix))


def test_trace_covers_the_chosen_steps_only(tmp_path):
    trainer = tiny_trainer(
        tmp_path,
        "--training.steps",
        "6",
        "--profiler.enable",
        "true",
        "--profiler.start_step",
        "3",
        "--profiler.end_step",
        "4",
    )
    trainer.train()
    trainer.close()
    folder = tmp_path / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_step3-4.json", "rank0_step3-4.txt"]
    # Two recorded steps (the warm-up step 2 and steps 1, 5, 6 are not in the trace); the
    # profiler numbers its own steps from 0 at the run's first step: steps 3 and 4 are #2, #3.
    trace = folder / "rank0_step3-4.json"
    assert _spans(trace, "train_step") == ["train_step 3", "train_step 4"]
    assert _spans(trace, "ProfilerStep#") == ["ProfilerStep#2", "ProfilerStep#3"]
    table = (folder / "rank0_step3-4.txt").read_text()
    assert "aten::mm" in table or "aten::addmm" in table  # the model's matmuls were traced


def test_a_run_stopped_inside_the_window_writes_what_it_traced(tmp_path):
    trainer = tiny_trainer(
        tmp_path,
        "--training.steps",
        "3",
        "--profiler.enable",
        "true",
        "--profiler.start_step",
        "2",
        "--profiler.end_step",
        "10",
        "--profiler.folder",
        str(tmp_path / "elsewhere"),
    )
    trainer.train()
    trainer.close()
    trace = tmp_path / "elsewhere" / "rank0_step2-3.json"
    assert _spans(trace, "train_step") == ["train_step 2", "train_step 3"]  # not warm-up 1


def test_the_schedule_maps_training_steps():
    actions = [step_action(s, 3, 5) for s in range(1, 8)]
    assert [a.name for a in actions] == [
        "NONE",
        "WARMUP",
        "RECORD",
        "RECORD",
        "RECORD_AND_SAVE",
        "NONE",
        "NONE",
    ]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"start_step": 0}, "profiler.start_step must be >= 1"),
        ({"start_step": 4, "end_step": 3}, "profiler.end_step=3 must be >= profiler.start_step=4"),
        ({"memory_snapshot_steps": "1,x"}, "profiler.memory_snapshot_steps must be a comma"),
    ],
)
def test_bad_profiler_settings_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        ProfilerConfig(**overrides)


def test_a_window_after_the_last_step_warns(tmp_path):
    with pytest.warns(UserWarning, match="profiler.start_step=100 is after the run's last step"):
        trainer = tiny_trainer(
            tmp_path,
            "--training.steps",
            "2",
            "--profiler.enable",
            "true",
            "--profiler.start_step",
            "100",
            "--profiler.end_step",
            "100",
        )
    trainer.close()


def test_memory_snapshot_on_cpu_warns_and_writes_nothing(tmp_path):
    with pytest.warns(UserWarning, match="profiler.memory_snapshot records the CUDA"):
        trainer = tiny_trainer(
            tmp_path, "--training.steps", "2", "--profiler.memory_snapshot", "true"
        )
    trainer.train()
    trainer.close()
    assert not (tmp_path / "profile").exists()


class FakeCudaMemory:
    """Stands in for torch.cuda.memory: records the calls, writes a small pickle per dump."""

    def __init__(self):
        self.calls: list[tuple] = []

    def _record_memory_history(self, enabled="all", **kwargs):
        self.calls.append(("record", enabled, kwargs.get("max_entries")))

    def _dump_snapshot(self, filename):
        self.calls.append(("dump", Path(filename).name))
        Path(filename).write_bytes(pickle.dumps({"segments": []}))


def test_memory_snapshots_at_chosen_steps_and_once_on_oom(tmp_path):
    memory = FakeCudaMemory()
    cfg = ProfilerConfig(
        memory_snapshot=True, memory_snapshot_steps="1,3", memory_snapshot_entries=500
    )
    prof = RunProfiler(
        cfg,
        tmp_path,
        rank=1,
        device=torch.device("cuda"),
        total_steps=5,
        log=lambda *a: None,
        memory=memory,
    )
    assert memory.calls == [("record", "all", 500)]  # recording starts at construction
    for step in (1, 2, 3):
        prof.step_done(step)
    for _ in range(2):  # the OOM passes two guards (train_step's and train's): one dump
        with pytest.raises(torch.OutOfMemoryError), prof.oom_guard(), prof.oom_guard():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
    prof.close()
    assert [c for c in memory.calls if c[0] == "dump"] == [
        ("dump", "rank1_step1.pickle"),
        ("dump", "rank1_step3.pickle"),
        ("dump", "rank1_oom.pickle"),
    ]
    assert memory.calls[-1] == ("record", None, None)  # and stops at close
    assert sorted(p.name for p in (tmp_path / "profile" / "memory").iterdir()) == [
        "rank1_oom.pickle",
        "rank1_step1.pickle",
        "rank1_step3.pickle",
    ]


def test_other_errors_write_no_snapshot(tmp_path):
    memory = FakeCudaMemory()
    prof = RunProfiler(
        ProfilerConfig(memory_snapshot=True),
        tmp_path,
        rank=0,
        device=torch.device("cuda"),
        total_steps=5,
        memory=memory,
    )
    with pytest.raises(ValueError), prof.oom_guard():
        raise ValueError("not a memory error")
    assert not any(c[0] == "dump" for c in memory.calls)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_cuda_memory_snapshot(tmp_path):
    trainer = tiny_trainer(
        tmp_path,
        "--job.device",
        "cuda",
        "--training.steps",
        "2",
        "--profiler.memory_snapshot",
        "true",
        "--profiler.memory_snapshot_steps",
        "2",
    )
    trainer.train()
    trainer.close()
    snapshot = pickle.loads((tmp_path / "profile" / "memory" / "rank0_step2.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"]
    memory = FakeCudaMemory()  # the OOM path on a real OOM, with a stand-in writer
    prof = RunProfiler(
        ProfilerConfig(memory_snapshot=True),
        tmp_path / "oom",
        rank=0,
        device=torch.device("cuda"),
        total_steps=1,
        memory=memory,
    )
    with pytest.raises(torch.OutOfMemoryError), prof.oom_guard():
        torch.empty(2**50, dtype=torch.uint8, device="cuda")  # a petabyte
    assert ("dump", "rank0_oom.pickle") in memory.calls


# -- Flight Recorder ----------------------------------------------------------------------


def test_flight_recorder_sets_its_variables(tmp_path):
    env: dict[str, str] = {}
    set_here = enable_flight_recorder(tmp_path / "fr", 500, env)
    prefix = os.path.join(str(tmp_path / "fr"), "rank_")
    assert (
        env
        == set_here
        == {
            "TORCH_FR_BUFFER_SIZE": "500",
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "500",
            "TORCH_FR_DUMP_TEMP_FILE": prefix,
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        }
    )
    assert (tmp_path / "fr").is_dir()


def test_flight_recorder_keeps_what_the_user_set(tmp_path):
    # The user's older-name buffer size (0: off) and dump setting win; the file is tidal's.
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    set_here = enable_flight_recorder(tmp_path / "fr", 2000, env)
    assert set(set_here) == {"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "0" and "TORCH_FR_BUFFER_SIZE" not in env
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


@pytest.mark.parametrize(
    "device, world, on, expected",
    [
        ("cuda", 2, True, True),
        ("cuda", 1, True, False),
        ("cpu", 4, True, False),
        ("cuda", 8, False, False),
    ],
    ids=["nccl", "one-rank", "gloo", "turned-off"],
)
def test_the_trainer_turns_it_on_for_nccl_jobs_only(tmp_path, device, world, on, expected):
    env: dict[str, str] = {}
    cfg = DebugConfig(flight_recorder=on, flight_recorder_folder="fr")
    folder = setup_flight_recorder(
        cfg, tmp_path, device=torch.device(device), world_size=world, environ=env
    )
    assert (folder == tmp_path / "fr") if expected else folder is None
    assert bool(env) == expected
    if expected:
        assert env["TORCH_FR_DUMP_TEMP_FILE"] == os.path.join(str(tmp_path / "fr"), "rank_")


def test_a_cpu_run_sets_no_flight_recorder_variables(tmp_path, monkeypatch):
    for name in (
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_FR_DUMP_TEMP_FILE",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
    ):
        monkeypatch.delenv(name, raising=False)
    tiny_trainer(tmp_path, "--training.steps", "1").close()  # gloo (or no group): not NCCL
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ
    assert not (tmp_path / "flight_recorder").exists()


# -- Weights & Biases (a stand-in `wandb` module: the package is optional) -----------------


class FakeRun:
    def __init__(self, kwargs):
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.runs: list[FakeRun] = []

    def init(self, **kwargs):
        self.runs.append(FakeRun(kwargs))
        return self.runs[-1]


def test_wandb_gets_the_records_next_to_metrics_jsonl(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    trainer = tiny_trainer(
        tmp_path,
        "--training.steps",
        "4",
        "--metrics.log_every",
        "2",
        "--metrics.wandb",
        "true",
        "--metrics.wandb_project",
        "proj",
    )
    trainer.train()
    trainer.close()
    (run,) = fake.runs
    kw = run.kwargs
    assert kw["project"] == "proj" and kw["entity"] is None and kw["name"] == "debug"
    assert kw["dir"] == str(tmp_path / "wandb") and kw["resume"] == "allow"
    assert kw["id"] == (tmp_path / "wandb_id.txt").read_text().strip()
    assert kw["config"]["training"]["steps"] == 4 and kw["config"]["run"]["world_size"] == 1
    records = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [step for step, _ in run.logged] == [r["step"] for r in records] == [2, 4]
    assert run.logged[-1][1]["loss"] == records[-1]["loss"]
    assert "step" not in run.logged[-1][1] and "mfu" not in run.logged[-1][1]  # None: skipped
    assert run.finished


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    from tidal.train.metrics import MetricsLogger

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    first = MetricsLogger(tmp_path, wandb={"project": "p"}, stream=io.StringIO())
    first.log({"step": 1, "loss": 2.0, "interrupted": True})
    first.close()
    MetricsLogger(tmp_path, wandb={"project": "p"}, resume_step=1, stream=io.StringIO()).close()
    assert fake.runs[0].kwargs["id"] == fake.runs[1].kwargs["id"]
    assert fake.runs[0].logged == [(1, {"loss": 2.0})]  # booleans are not metrics


def test_wandb_enabled_but_missing_fails_before_the_run(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ValueError, match=r"metrics.wandb=true needs the wandb package"):
        tiny_trainer(tmp_path, "--metrics.wandb", "true")
    assert not (tmp_path / "metrics.jsonl").exists()
