"""Every benchmark script runs at its smallest size and writes well-formed results (no timing asserted)."""

from __future__ import annotations

import json
import sys

import pytest

from .conftest import run_cmd

pytestmark = pytest.mark.timeout(600)

EXPECTED_KEYS = {
    "overhead": {"zero_stage", "processes", "raw_ms", "fit_ms", "ratio_fit_over_raw"},
    "stalls": {"compute_ms", "data_ms", "naive_over_max", "fit_over_max"},
    "first_step": {"raw_s", "train_py_s", "ratio"},
    "memory": {
        "model",
        "setup",
        "peak_rss_MB",
        "peak_minus_baseline_MB",
        "state_MB",
        "formula_MB",
        "step_ms",
        "ranks",
    },
    "peers": {"task", "framework", "samples_per_s", "ours_over_theirs", "first_step_s"},
    "pipeline": {"micro_batches", "t1_ms", "t2_ms", "bubble_measured", "bubble_1f1b_theory"},
}


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory):
    """Each benchmark at --smoke size, once, into one dir; the return codes and stderr tails."""
    out = tmp_path_factory.mktemp("bench")
    runs = {}
    for name in EXPECTED_KEYS:
        run = run_cmd(
            [sys.executable, "-m", f"benchmarks.{name}", "--smoke", "--out-dir", str(out)], timeout=280
        )
        runs[name] = (run.returncode, run.stderr[-3000:])
    return out, runs


@pytest.mark.parametrize("name", list(EXPECTED_KEYS))
def test_benchmark_smoke(smoke_results, name):
    out, runs = smoke_results
    code, stderr = runs[name]
    assert code == 0, stderr
    result = json.loads((out / f"{name}.json").read_text())
    assert result["benchmark"] == name and result["machine"]["cpu_count"] >= 1
    assert result["rows"] and all(EXPECTED_KEYS[name] <= set(row) for row in result["rows"])
    numbers = [
        v
        for row in result["rows"]
        for k, v in row.items()
        if k in EXPECTED_KEYS[name] and isinstance(v, float)
    ]
    assert all(v == v and v >= 0 for v in numbers)  # measured, not NaN


def test_summary_table_from_results(smoke_results):
    from benchmarks.run import summary

    out, runs = smoke_results
    assert all(code == 0 for code, _ in runs.values())
    text = summary(out, "smoke")
    assert text.count("\n| ") >= 8 and "| overhead: Engine.fit / raw DeepSpeed, ZeRO-0, 1 proc |" in text
    assert "pipeline: bubble at m=2" in text
