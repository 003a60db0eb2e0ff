"""Every benchmark script runs at its smallest size and writes well-formed results (no timing asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from .conftest import run_cmd

pytestmark = pytest.mark.timeout(600)

EXPECTED_KEYS = {
    "overhead": {"zero_stage", "processes", "raw_ms", "fit_ms", "ratio_fit_over_raw"},
    "exactness": {
        "mechanism",
        "processes",
        "with_ms",
        "without_ms",
        "ratio_with_over_without",
        "with_cpu_ms",
        "without_cpu_ms",
    },
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
    "streams": {"loader_tokens_per_s", "fit_tokens_per_s", "loader_over_consumption", "stream_over_map"},
    "grpo": {"part", "setup", "ranks", "seconds"},
    "finetune": {
        "framework",
        "peak_rss_MB",
        "step_s",
        "tokens_per_s",
        "rss_over_trl",
        "step_time_over_trl",
        "max_loss_diff",
    },
    "packing": {
        "packing",
        "rows",
        "pad_share",
        "pad_share_one_row",
        "tokens_per_s",
        "tokens_per_s_over_greedy",
    },
    "footprint": {"stage", "framework", "rss_MB", "ours_over_trl"},
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_summary_table_from_results(smoke_results):
    from benchmarks.run import summary

    out, runs = smoke_results
    assert all(code == 0 for code, _ in runs.values())
    text = summary(out, "smoke")
    assert text.count("\n| ") >= 8 and "| overhead: Engine.fit / raw DeepSpeed, ZeRO-0, 1 proc |" in text
    assert "pipeline: bubble at m=2" in text


@pytest.mark.slow
def test_grpo_benchmark_rows_carry_what_they_check(smoke_results):
    """What the GRPO benchmark's rows show besides times: LoRA's reference is the model with its
    adapters off (no weights held), the full model's copy is partitioned under ZeRO-3, and the
    rollout samples what the plain model's `generate` samples."""
    out, _ = smoke_results
    rows = json.loads((out / "grpo.json").read_text())["rows"]
    assert {"vs TRL", "step split", "generation", "memory"} <= {r["part"] for r in rows}
    memory = {(r["setup"].split(",")[0], r["stage"]): r for r in rows if r["part"] == "memory"}
    assert memory["LoRA r=8", 3]["reference_held_MB"] == 0
    assert 0 < memory["full", 3]["reference_held_MB"] < memory["full", 0]["reference_held_MB"]
    generation = {r["stage"]: r for r in rows if r["part"] == "generation"}
    assert generation[0]["plain_same_tokens"] is True and generation[3]["partitioned_share"] > 0.5


@pytest.fixture(scope="module")
def gpu_run_smoke(tmp_path_factory):
    """`python -m benchmarks.gpu_run --smoke`, once: gpu_check then gpu_bench on the CPU."""
    out = tmp_path_factory.mktemp("gpu_run")
    run = run_cmd([sys.executable, "-m", "benchmarks.gpu_run", "--smoke", "--out-dir", str(out)], timeout=560)
    return out, run


@pytest.mark.slow
def test_gpu_check_smoke_runs_on_the_cpu(gpu_run_smoke):
    out, run = gpu_run_smoke
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["passed"] and report["device"] == "cpu" and len(report["checks"]) >= 8, run.stdout[-4000:]
    assert all(c["ok"] for c in report["checks"] if not c.get("skipped")), report["checks"]


@pytest.mark.slow
def test_gpu_run_prints_both_tables(gpu_run_smoke):
    out, run = gpu_run_smoke
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    text = (out / "gpu_run.md").read_text()
    assert "### gpu_check: cpu — passed" in text and "| train_py | ok |" in text
    assert "### GPU benchmark: cpu" in text and text in run.stdout


@pytest.mark.slow
def test_gpu_bench_smoke_runs_every_row_on_the_cpu(gpu_run_smoke):
    """`benchmarks.gpu_bench --smoke`: ours, raw DeepSpeed with the identical JSON, each peer,
    offload (dropped on a CPU) and the compile rows, in one process, with both tables written."""
    from benchmarks.gpu_bench import plan

    tmp_path, run = gpu_run_smoke
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    rows = report["rows"]
    assert [(r["setup"], r["framework"]) for r in rows] == [(r["setup"], r["framework"]) for r in plan(True)]
    for row in rows:
        if row["framework"] in report["missing"]:
            assert row["status"].startswith("missing")
            continue
        assert row["status"] == "ok", row
        assert row["tokens_per_s"] > 0 and row["first_step_s"] > 0 and row["peak_mem_GB"] > 0
        assert row["profile"]["step_ms"] > 0  # the steps after the measured window, profiled
    assert {"accelerate", "lightning"} <= {r["framework"] for r in rows}
    offload = [r for r in rows if r["offload"] and r["status"] == "ok"]
    assert offload and all(r["ran"] == "ZeRO-3 | bf16" for r in offload)  # no accelerator: offload dropped
    assert all(r["compiled"] is False for r in rows if r["compile"])
    ratios = {e["setup"]: e for e in report["ratios"]}
    assert set(ratios) == {r["setup"] for r in rows}
    assert all(e["same_deepspeed_json"] for e in ratios.values())  # ours and raw got one JSON
    assert all(e["ours_over_deepspeed"] > 0 for e in ratios.values())
    text = (tmp_path / "gpu_bench.md").read_text()
    assert "| ZeRO-3 + offload | hydraspeed |" in text and "| setup | ours / DeepSpeed |" in text


def test_gpu_bench_ratios_name_each_missed_target():
    from benchmarks.gpu_bench_report import ratios

    def row(framework, tokens, stage=1, mfu=None, config="a"):
        return {"setup": f"ZeRO-{stage}", "framework": framework, "stage": stage, "offload": False,
                "status": "ok", "tokens_per_s": tokens, "mfu": mfu, "config": config}  # fmt: skip

    rows = [
        row("hydraspeed", 97.0, mfu=0.35),
        row("deepspeed", 100.0),
        row("accelerate", 90.0),
        {
            "setup": "ZeRO-1",
            "framework": "lightning",
            "stage": 1,
            "offload": False,
            "status": "missing: lightning",
        },
        row("hydraspeed", 100.0, stage=3, mfu=0.2),
        row("deepspeed", 100.0, stage=3, config="b"),
    ]
    first, third = ratios(rows)
    assert first["ours_over_deepspeed"] == 0.97 and first["ours_over_accelerate"] > 1.07
    assert first["ours_over_lightning"] is None and first["same_deepspeed_json"] is True
    assert first["misses"] == ["ours/deepspeed < 0.98", "MFU < 40%"]
    assert third["misses"] == [] and third["same_deepspeed_json"] is False  # no MFU target at ZeRO-3


def test_peer_wheels_cover_what_the_peers_import_but_not_torch():
    from benchmarks.wheels import closure, install_missing

    for module, extra in (("transformers", "hf"), ("accelerate", "hf"), ("lightning", "bench")):
        if importlib.util.find_spec(module) is None:  # not imported: lightning alone takes seconds
            pytest.skip(f"needs the {extra} extra: pip install -e '.[{extra}]'")

    found = closure(["transformers", "accelerate", "lightning"])
    assert {"transformers", "accelerate", "lightning", "lightning-utilities", "tokenizers"} <= set(found)
    assert not {"torch", "numpy", "colorama"} & set(found)  # the machine's own builds; Windows only
    assert install_missing(["json"]) == []  # nothing missing: nothing installed


def test_peer_wheels_install_only_what_is_missing_and_fits_this_python(tmp_path):
    from benchmarks.wheels import to_install

    names = [
        "torch-9.9.9-py3-none-any.whl",  # installed here: left alone
        "not_installed_here-1.0-py3-none-any.whl",
        "other_platform-1.0-cp27-cp27m-win32.whl",  # would fail the install
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in to_install(tmp_path)] == ["not_installed_here-1.0-py3-none-any.whl"]


def test_gpu_bench_row_past_its_timeout_or_the_budget_is_reported_not_waited_for():
    from benchmarks.gpu_bench import run_all, run_rows
    from benchmarks.llm import SMOKE

    row = {"setup": "ZeRO-0", "framework": "hydraspeed", "stage": 0, "offload": False, "compile": False}
    (timed_out,) = run_rows([row], SMOKE, timeout_s=1, smoke=True)  # killed while importing
    assert timed_out["status"] == "failed: timed out after 1 s"
    rows = run_all(SMOKE, smoke=False, base_timeout=75, budget_s=10, only="ZeRO-0 /")
    assert rows and all(r["status"] == "not run: time budget spent" for r in rows)


def test_step_profile_summary_reads_busy_share_top_kernels_and_host_waits():
    import types

    from benchmarks.step_profile import summarise

    def event(device, name, start, end):
        return types.SimpleNamespace(
            device_type=types.SimpleNamespace(name=device),
            name=name,
            time_range=types.SimpleNamespace(start=start, end=end),
        )

    events = [
        event("CUDA", "gemm", 0, 400),
        event("CUDA", "softmax", 300, 500),  # overlaps the gemm: busy 0-500
        event("CUDA", "gemm", 800, 1000),  # a gap of 300 before it
        event("CPU", "cudaStreamSynchronize", 500, 800),
        event("CPU", "cudaMemcpyAsync", 100, 110),  # asynchronous: not a wait
        event("CPU", "aten::mm", 0, 50),
    ]
    summary = summarise(events, wall_s=0.001, steps=2)
    assert summary["gpu_busy"] == 0.7 and summary["step_ms"] == 0.5
    assert summary["top_kernels_ms"] == [("gemm", 0.3), ("softmax", 0.1)]
    assert summary["host_sync_calls"] == 0.5 and summary["host_sync_ms"] == 0.15
