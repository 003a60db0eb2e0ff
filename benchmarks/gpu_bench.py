"""Throughput of a ~1 B Llama on one GPU: Engine.fit next to raw DeepSpeed with the identical
DeepSpeed JSON, HF Accelerate's DeepSpeed plugin and Lightning's DeepSpeedStrategy.

    python -m benchmarks.gpu_bench                 # one GPU, about 6 minutes, no network
    python -m benchmarks.gpu_bench --smoke         # tiny model on the CPU, every code path (the suite)

Setups: ZeRO-0, 1, 2, 3 and ZeRO-3 + optimizer offload (bf16, sequence 2048, micro-batch 8), then
`strategy.compile` at ZeRO-0 and 1. Each row trains a fixed number of steps after a warm-up in its
own process (clean memory and process group) under a per-row timeout, inside an overall time
budget: a row that fails or runs out of time is reported as such and the others still run. Each
row: tokens/s, MFU against the GPU's spec bf16 peak (6 N + 12 L d T FLOPs per token), peak GPU
memory, time from process start to the end of the first step; per setup the ratios ours / raw and
ours / peer, measured in the same call. Peers missing on a machine without network are installed
from wheels (`--wheels`, default benchmarks/wheels/, filled by `python -m benchmarks.wheels`) with
`pip install --no-index --no-deps`; a peer still missing is named in the table.

Writes gpu_bench.json and gpu_bench.md (under --out-dir, else a temporary dir for --smoke, else
$OUT when set, else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS
from benchmarks.gpu_bench_report import markdown, ratios
from benchmarks.llm import SMOKE, Setup
from benchmarks.wheels import WHEELS, install_missing

ROOT = Path(__file__).resolve().parents[1]
PEERS = ["accelerate", "lightning"]
NEEDED = ["transformers", *PEERS]
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DS_ACCELERATOR",
)


def plan(smoke: bool, only: str | None = None) -> list[dict[str, Any]]:
    """The rows in the order they run, most wanted first: every framework at ZeRO-0..3, ours and
    raw under offload, compile (the first graph takes a minute or more) ours then raw, the peers
    under offload. `only`: rows whose "setup / framework" contains it."""
    rows = []

    def add(setup: str, framework: str, stage: int, offload: bool = False, compile: bool = False) -> None:
        row = {"setup": setup, "framework": framework, "stage": stage, "offload": offload, "compile": compile}
        if only is None or only.lower() in f"{setup} / {framework}".lower():
            rows.append(row)

    peers = [] if smoke else PEERS  # --smoke: one row per peer (Accelerate keeps one state per process)
    for stage in (0, 1, 2, 3):
        for framework in ("hydraspeed", "deepspeed", *peers, *(PEERS if smoke and stage == 2 else [])):
            add(f"ZeRO-{stage}", framework, stage)
    for framework in ("hydraspeed", "deepspeed"):
        add("ZeRO-3 + offload", framework, 3, offload=True)
    for stage in (0, 1):
        for framework in ("hydraspeed", "deepspeed"):
            add(f"ZeRO-{stage} + compile", framework, stage, compile=True)
    for framework in peers:
        add("ZeRO-3 + offload", framework, 3, offload=True)
    return rows


def row_timeout(row: dict[str, Any], base: float) -> float:
    """Seconds a row may take: longer under offload (CPU Adam) and compile (the first graph)."""
    return base * (2.5 if row["compile"] else 1.6 if row["offload"] else 1.0)


def _child_env(smoke: bool) -> dict[str, str]:
    """This environment without a launcher's or an earlier run's variables, stamped with the start."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(BENCH_T0=repr(time.time()), PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    if smoke:
        # Inductor takes ~2 minutes on two CPU cores: the compile rows go through strategy.compile
        # and module.compile() with torch.compile turned off (the row's `compiled` says so).
        env.update(TORCH_COMPILE_DISABLE="1", CUDA_VISIBLE_DEVICES="")
    return env


def run_rows(rows: list[dict[str, Any]], setup: Setup, timeout_s: float, smoke: bool) -> list[dict[str, Any]]:
    """Run `rows` in one child process; the rows it printed, the others marked with why not."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_bench_worker", json.dumps(setup.to_dict()), json.dumps(rows)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_child_env(smoke), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
        why = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        why = f"timed out after {timeout_s:.0f} s"
    done = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
    for row in rows[len(done) :]:
        done.append({**row, "status": f"failed: {why}", "trace": err[-1500:]})
    return done


def run_all(
    setup: Setup, smoke: bool, base_timeout: float, budget_s: float, only: str | None = None
) -> list[dict[str, Any]]:
    """Every planned row: in one process for --smoke, else one process per row within the budget."""
    rows = plan(smoke, only)
    if smoke:
        return run_rows(rows, setup, budget_s, smoke)
    deadline, results = time.monotonic() + budget_s, []
    for row in rows:
        left = deadline - time.monotonic()
        if left < 30:
            results.append({**row, "status": "not run: time budget spent"})
            continue
        results.extend(run_rows([row], setup, min(row_timeout(row, base_timeout), left), smoke))
        print(_progress(results[-1]), flush=True)
    return results


def _progress(row: dict[str, Any]) -> str:
    name = f"{row['setup']:18s} {row['framework']:11s}"
    if row["status"] != "ok":
        return f"{name} {row['status'][:150]}"
    return f"{name} {row['tokens_per_s']:10.0f} tokens/s  {row['peak_mem_GB']:6.1f} GB  first step {row['first_step_s']:.1f} s"


def versions() -> dict[str, Any]:
    """torch, CUDA, DeepSpeed and the peers' versions (None where not installed)."""
    from importlib import metadata

    import torch

    found: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("deepspeed", "transformers", "accelerate", "lightning"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def _device_name(smoke: bool) -> str:
    """The GPU's name (when no row reported it: all failed), else "cpu"."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() and not smoke else "cpu"


def _out_dir(given: Path | None, smoke: bool) -> Path:
    if given is not None:
        return given
    if smoke:
        return Path(tempfile.mkdtemp(prefix="gpu_bench_smoke_"))
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, all rows in one process")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--wheels", type=Path, default=WHEELS, help="wheels to install a missing peer from")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="overall seconds (default 420; smoke 400)"
    )
    parser.add_argument(
        "--only", default=None, help='rows whose "setup / framework" contains this, e.g. offload'
    )
    parser.add_argument(
        "--row-timeout-s", type=float, default=75.0, help="seconds per row (x1.6 offload, x2.5 compile)"
    )
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="measured steps after the warm-up")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the rows, write gpu_bench.json and gpu_bench.md, print the table."""
    args = parse(argv)
    setup = SMOKE if args.smoke else Setup()
    changes = {
        k: v for k, v in (("micro_batch", args.micro_batch), ("seq", args.seq), ("steps", args.steps)) if v
    }
    setup = dataclasses.replace(setup, **changes)
    installed = install_missing(NEEDED, args.wheels)
    start = time.perf_counter()
    budget = args.budget_s or (400 if args.smoke else 420)
    rows = run_all(setup, args.smoke, args.row_timeout_s, budget, args.only)
    missing = sorted({r["framework"] for r in rows if r["status"].startswith("missing")})
    report = {
        "benchmark": "gpu_bench",
        "smoke": args.smoke,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": next((r["gpu"] for r in rows if r.get("gpu")), None) or _device_name(args.smoke),
        "versions": versions(),
        "setup": setup.to_dict(),
        "installed_from_wheels": installed,
        "missing": missing,
        "seconds": round(time.perf_counter() - start, 1),
        "rows": rows,
        "ratios": ratios(rows),
    }
    out_dir = _out_dir(args.out_dir, args.smoke)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_bench.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    (out_dir / "gpu_bench.md").write_text(text)
    print(text)
    print(f"written: {out_dir / 'gpu_bench.json'}, {out_dir / 'gpu_bench.md'}")
    return report


if __name__ == "__main__":
    main()
