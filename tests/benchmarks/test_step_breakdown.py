"""benchmarks/step_breakdown.py: kernel time by kind and GPU idle time of a step, on a
hand-made trace of the profiler's format (CPU only)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "step_breakdown.py"


@pytest.fixture(scope="module")
def mod():
    spec = importlib.util.spec_from_file_location("step_breakdown", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _x(name, cat, ts, dur):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}


def test_kernels_are_summed_by_kind_inside_each_step(mod):
    trace = {
        "traceEvents": [
            _x("train_step 5", "user_annotation", 0, 1000),
            _x("train_step 5", "gpu_user_annotation", 0, 1000),  # the GPU copy: not a step
            _x("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 100, 300),
            _x("pytorch_flash::flash_fwd_kernel", "kernel", 400, 100),
            _x("triton_per_fused_add_mean_mul_pow_rsqrt_0", "kernel", 500, 50),
            _x("triton_red_fused_1", "kernel", 520, 60),  # overlaps the one before (streams)
            _x("void at::native::(anonymous)::multi_tensor_apply_kernel<Adam>", "kernel", 800, 100),
            _x("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 950, 10),
            _x("train_step 6", "user_annotation", 2000, 500),
            _x("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", "kernel", 2100, 200),
            _x("some_custom_kernel", "kernel", 2450, 100),  # runs past its step's span: counted
        ]
    }
    rec = mod.breakdown(trace)  # window 0 .. 2550 (the last kernel ends after its span)
    assert rec["steps"] == 2 and rec["wall_ms"] == pytest.approx(2.55 / 2)
    assert rec["kernels_ms"] == pytest.approx(
        {
            "gemm": 0.25,
            "attention": 0.05,
            "optimizer": 0.05,
            "inductor (triton)": 0.055,
            "copy / memset": 0.005,
            "other": 0.05,
        }
    )
    assert rec["gpu_busy_ms"] == pytest.approx((0.3 + 0.1 + 0.08 + 0.1 + 0.01 + 0.2 + 0.1) / 2)
    assert rec["longest_idle_ms"] == pytest.approx(1.14)  # 960 -> 2100


def test_a_trace_without_steps_is_refused(mod):
    with pytest.raises(SystemExit, match="no 'train_step' spans"):
        mod.breakdown({"traceEvents": [_x("gemm", "kernel", 0, 1)]})
