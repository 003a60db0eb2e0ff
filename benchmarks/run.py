"""Run every benchmark and summarise the ratios that have targets.

    python -m benchmarks.run --quick      # under ~10 minutes on 2 cores
    python -m benchmarks.run              # longer, steadier numbers

Each benchmark runs in its own process and writes benchmarks/results/<name>.json;
this writes benchmarks/results/summary.md (the table the README's Performance section shows).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, machine

BENCHMARKS = [
    "overhead",
    "exactness",
    "stalls",
    "first_step",
    "memory",
    "peers",
    "pipeline",
    "streams",
    "grpo",
    "packing",
    "footprint",
]


def _gpt_case(row: dict) -> str:
    """The transformer is measured at two micro-batch sizes and on 2 and 4 ranks: which one."""
    ranks = row.get("ranks", 2)
    return f"micro-batch {row['micro_batch']}{f', {ranks} ranks' if ranks != 2 else ''}"


def _micro_batch_label(row: dict) -> str:
    return f" ({_gpt_case(row)})" if row["model"] == "gpt25m" else ""


def _rows(name: str, out_dir: Path) -> list[dict]:
    return json.loads((out_dir / f"{name}.json").read_text())["rows"]


def summary(out_dir: Path, command: str) -> str:
    """The markdown table of headline ratios, from the JSON files."""
    lines = ["| benchmark | measured | target | met |", "|---|---|---|---|"]

    def add(name: str, measured: str, target: str, met: bool) -> None:
        lines.append(f"| {name} | {measured} | {target} | {'yes' if met else '**no**'} |")

    for row in _rows("overhead", out_dir):
        r = row["ratio_fit_over_raw"]
        add(
            f"overhead: Engine.fit / raw DeepSpeed, ZeRO-{row['zero_stage']}, {row['processes']} proc",
            f"{r:.3f}",
            "<= 1.03",
            r <= 1.03,
        )
    for row in _rows("exactness", out_dir):
        r = row["ratio_with_over_without"]
        add(
            f"exactness: Engine.fit with / without the {row['mechanism']}, {row['processes']} proc",
            f"{r:.3f}",
            "<= 1.03",
            r <= 1.03,
        )
    for row in _rows("stalls", out_dir):
        r = row["fit_over_max"]
        add(
            f"data stalls: C={row['compute_ms']:.0f} ms, D={row['data_ms']:.0f} ms (naive {row['naive_over_max']:.2f})",
            f"{r:.3f}",
            "<= 1.10",
            r <= 1.10,
        )
    for row in _rows("first_step", out_dir):
        add(
            "time to first step: train.py / raw script",
            f"{row['ratio']:.2f} ({row['train_py_s']:.1f} s vs {row['raw_s']:.1f} s)",
            "<= 1.10",
            row["ratio"] <= 1.10,
        )
    for row in _rows("memory", out_dir):
        if row["setup"].startswith("ours"):
            ok = 0.9 <= row["state_over_formula"] <= 1.1
            add(
                f"memory: {row['model']} {row['setup']}{_micro_batch_label(row)}, model states / formula",
                f"{row['state_over_formula']:.3f}",
                "0.9 - 1.1",
                ok,
            )
    mem = _rows("memory", out_dir)
    for row in mem:  # the transformer: each stage's peak against ZeRO-0's less 75% of its state saving
        if (
            row["model"] == "gpt25m"
            and row["setup"] in ("ours ZeRO-2", "ours ZeRO-3")
            and "target_peak_MB" in row
        ):
            peak, target = row["peak_minus_baseline_MB"], row["target_peak_MB"]
            if row["micro_batch"] >= 32 and row["setup"] == "ours ZeRO-3":
                target = peak / row["peak_vs_ours_zero0"]  # at a large micro-batch: not above ZeRO-0
            add(
                f"memory: gpt25m {row['setup'][5:]} peak-minus-baseline, {_gpt_case(row)} (MB)",
                f"{peak:.0f} ({row['peak_vs_ours_zero0']:.2f} of ZeRO-0's)",
                f"<= {target:.0f}",
                peak <= target,
            )
    for model in sorted({r["model"] for r in mem} - {"gpt25m"}):
        z3 = next((r for r in mem if r["model"] == model and r["setup"] == "ours ZeRO-3"), None)
        off = next(
            (r for r in mem if r["model"] == model and r["setup"].startswith("ours ZeRO-3 + offload")), None
        )
        raw3 = next((r for r in mem if r["model"] == model and r["setup"] == "raw ZeRO-3"), None)
        if z3:
            add(
                f"memory: {model} ZeRO-3 peak-minus-baseline / ZeRO-0's",
                f"{z3['peak_vs_ours_zero0']:.2f}",
                "<= 0.75",
                z3["peak_vs_ours_zero0"] <= 0.75,
            )
        if off:
            r = off["peak_vs_ours_zero0"]
            add(
                f"memory: {model} ZeRO-3 + offload peak-minus-baseline / ZeRO-0's",
                f"{r:.2f}",
                "<= 1.0",
                r <= 1.0,
            )
        if z3 and raw3:
            r = z3["step_ms"] / raw3["step_ms"]
            add(
                f"memory: {model} ZeRO-3 step time, auto / DeepSpeed defaults", f"{r:.2f}", "<= 1.0", r <= 1.0
            )
    for row in _rows("peers", out_dir):
        r, spread = row["ours_over_theirs"], f" [{row['spread']}]" if "spread" in row else ""
        if row["framework"].startswith("plain"):  # the floor: step time ours / plain = 1 / this
            if "spread" in row:
                low, high = (float(x) for x in row["spread"].split("-"))
                spread = f" [{1 / high:.2f}-{1 / low:.2f}]"
            add(
                f"floor: {row['task']} step time, Engine.fit ZeRO-0 / {row['framework']}",
                f"{1 / r:.3f}{spread}",
                "<= 1.02",
                1 / r <= 1.02,
            )
        elif row["framework"] != "hydraspeed":
            add(
                f"peers: {row['task']} throughput, ours / {row['framework']}",
                f"{r:.2f}{spread}",
                ">= 1.0",
                r >= 1.0,
            )
    for row in _rows("pipeline", out_dir):
        add(
            f"pipeline: bubble at m={row['micro_batches']} (theory {row['bubble_1f1b_theory']:.2f})",
            f"{row['bubble_measured']:.2f}",
            "reported",
            True,
        )
    for row in _rows("streams", out_dir):
        r = row["stream_over_map"]
        add(
            "streams: GPT step time, streaming data / the same blocks map-style",
            f"{r:.3f}",
            "<= 1.05",
            r <= 1.05,
        )
        r = row["loader_over_consumption"]
        add("streams: loader tokens/s / tokens/s the step consumes", f"{r:.1f}", "> 1", r > 1)
    for row in _rows("grpo", out_dir):
        if row["part"] == "vs TRL" and "ours_over_trl" in row:
            r = row["ours_over_trl"]
            add(
                f"GRPO: {row['steps']}-step job training time, ours ZeRO-0 / TRL GRPOTrainer, 1 proc",
                f"{r:.2f}",
                "<= 1.5",
                r <= 1.5,
            )
        if row["part"] == "grpo_tiny":
            ok = row["seconds"] < 300 and row["reward_last10"] >= 0.8
            add(
                f"GRPO: experiment=grpo_tiny {row['setup']}, wall time and mean reward (first -> last 10 steps)",
                f"{row['seconds']:.0f} s, {row['reward_first10']:.2f} -> {row['reward_last10']:.2f}",
                "< 300 s, >= 0.8",
                ok,
            )
    for row in _rows("footprint", out_dir):
        r = row["ours_over_trl"]
        if row["framework"] == "hydraspeed" and row["stage"] == "after building the run":
            add(
                "footprint: RSS after imports + building a tiny LoRA run, ours / TRL's stack",
                f"{r:.2f} ({row['rss_MB']:.0f} MB)" if r is not None else f"{row['rss_MB']:.0f} MB (no TRL)",
                "<= 1.05",
                r is None or r <= 1.05,
            )
    m = machine()
    head = (
        f"Measured {m['date']} with `{command}` on {m['cpu_count']} CPU cores, no GPU "
        f"({m['platform']}; Python {m['python']}, torch {m['torch']}, DeepSpeed {m['deepspeed']}).\n\n"
    )
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks, each in its own process, then write the summary."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", default=BENCHMARKS, choices=BENCHMARKS)
    args = parser.parse_args(argv)
    flag = ["--quick"] if args.quick else []
    failed = []
    for name in args.only:
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        if subprocess.run(
            [sys.executable, "-m", f"benchmarks.{name}", *flag], cwd=Path(__file__).resolve().parents[1]
        ).returncode:
            failed.append(name)
        print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)
    if set(BENCHMARKS) <= {p.stem for p in RESULTS.glob("*.json")}:
        text = summary(RESULTS, "python -m benchmarks.run" + (" --quick" if args.quick else ""))
        (RESULTS / "summary.md").write_text(text)
        print(text)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
