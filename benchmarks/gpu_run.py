"""The one prepared command for a GPU session: gpu_check, then gpu_bench in the time left, both
tables printed at the end.

    python -m benchmarks.wheels                  # before, on a machine with network (peers' wheels)
    python -m benchmarks.gpu_run                 # on the GPU machine: 9.5 minutes, no network
    python -m benchmarks.gpu_run --total-s 720   # more time: more of the benchmark's rows
    python -m benchmarks.gpu_run --smoke         # the same on the CPU, tiny sizes

By default both fit in 570 s (gpu_check at most 300 s, the benchmark the rest, its most wanted
rows first); with more time the benchmark also measures offload and compile rows.

Writes gpu_check.json, gpu_bench.json, gpu_bench.md and gpu_run.md under --out-dir, else $OUT when
set, else benchmarks/results/ (a temporary dir for --smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.wheels import WHEELS

ROOT = Path(__file__).resolve().parents[1]


def check_table(path: Path) -> str:
    """gpu_check's report as a Markdown table (one row per check)."""
    if not path.exists():
        return "gpu_check wrote no report (see its output above).\n"
    report = json.loads(path.read_text())
    lines = [
        f"### gpu_check: {report.get('gpu') or report['device']} — {'passed' if report['passed'] else 'FAILED'}",
        "",
        "| check | result | seconds | detail |",
        "|---|---|---|---|",
    ]
    for c in report["checks"]:
        state = "skipped" if c.get("skipped") else ("ok" if c["ok"] else "**FAILED**")
        detail = json.dumps(c["detail"], default=str)[:200].replace("|", "/")
        lines.append(f"| {c['name']} | {state} | {c['seconds']} | {detail} |")
    return "\n".join(lines) + "\n"


def _run(cmd: list[str], timeout_s: float) -> int:
    """A child with its output on this console; killed at the timeout."""
    try:
        return subprocess.run(cmd, cwd=ROOT, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        print(f"timed out after {timeout_s:.0f} s: {' '.join(cmd[2:])}", flush=True)
        return 124


def main(argv: list[str] | None = None) -> int:
    """gpu_check, gpu_bench, both tables; non-zero when the check failed or the bench did not run."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--wheels", type=Path, default=WHEELS)
    parser.add_argument("--total-s", type=float, default=690.0, help="both commands together (default 690)")
    parser.add_argument(
        "--check-s", type=float, default=330.0, help="at most this for gpu_check (default 330)"
    )
    args = parser.parse_args(argv)
    default = Path(tempfile.mkdtemp(prefix="gpu_run_smoke_")) if args.smoke else None
    env_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    out = args.out_dir or default or env_out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    smoke = ["--smoke"] if args.smoke else []
    check_code = _run(
        [sys.executable, "-m", "benchmarks.gpu_check", *smoke, "--out-dir", str(out)], args.check_s
    )
    left = args.total_s - (time.monotonic() - start) - 20  # writing and printing
    bench = [
        sys.executable,
        "-m",
        "benchmarks.gpu_bench",
        *smoke,
        "--out-dir",
        str(out),
        "--wheels",
        str(args.wheels),
    ]
    bench_code = _run([*bench, "--budget-s", str(int(left))], left + 15) if left > 60 else 125
    tables = [check_table(out / "gpu_check.json")]
    bench_md = out / "gpu_bench.md"
    tables.append(bench_md.read_text() if bench_md.exists() else "gpu_bench wrote no table.\n")
    text = "\n".join(tables)
    (out / "gpu_run.md").write_text(text)
    print(f"\n{text}\n{time.monotonic() - start:.0f} s in all; written under {out}", flush=True)
    return 1 if check_code or bench_code else 0


if __name__ == "__main__":
    sys.exit(main())
