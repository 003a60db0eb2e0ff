"""Plots of a run's or a sweep's metrics against optimizer steps.

    python -m framework.plot RUN_OR_SWEEP_DIR [MORE_DIRS ...] [--out DIR]

Reads every `metrics.jsonl` under the given dirs and writes one PNG per quantity (loss, val_loss,
each metric, lr, samples/s, tokens/s, MFU, the step-time phases) with one line per run, so a
sweep's jobs compare in one figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SKIP = {"kind", "step", "epoch", "batches", "batches_total", "samples"}
# Names older records used -> the name they have now (TRL's): a quantity is one curve across both.
RENAMED = {"rewards/accuracy": "rewards/accuracies", "val_rewards/accuracy": "val_rewards/accuracies"}


def find_runs(paths: list[Path]) -> list[Path]:
    """Run dirs (holding a metrics.jsonl) at or under `paths`."""
    runs: list[Path] = []
    for path in paths:
        if (path / "metrics.jsonl").is_file():
            runs.append(path)
        else:
            runs += sorted(p.parent for p in path.glob("**/metrics.jsonl"))
    return runs


def run_labels(runs: list[Path]) -> dict[Path, str]:
    """Each run's name in a legend: the overrides that tell it apart from the other runs (a
    sweep's jobs), else its dir name."""
    import yaml

    overrides = {}
    for run in runs:
        file = run / ".hydra" / "overrides.yaml"
        overrides[run] = (yaml.safe_load(file.read_text()) or []) if file.is_file() else []
    common = set.intersection(*(set(o) for o in overrides.values())) if len(runs) > 1 else set()
    labels = {}
    for run in runs:
        own = [item for item in overrides[run] if item not in common]
        labels[run] = " ".join(own) if own else run.name
    return labels


def series(run: Path) -> dict[str, list[tuple[int, float]]]:
    """quantity -> [(step, value)] from a run's metrics.jsonl: per-step records where a quantity
    is logged per step (loss, lr), per-epoch / validation records for the rest (val_loss, ...)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    per_step = {key for r in records if r.get("kind") == "step" for key in r}
    out: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for old_or_new, value in record.items():
            key = RENAMED.get(old_or_new, old_or_new)
            if key in SKIP or not isinstance(value, (int, float)):
                continue
            if record.get("kind") != "step" and key in per_step:
                continue
            out.setdefault(key, []).append((int(record["step"]), float(value)))
    return {k: sorted(v) for k, v in out.items()}


def plot(paths: list[Path], out_dir: Path | None = None) -> list[Path]:
    """Write one PNG per quantity; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = find_runs(paths)
    if not runs:
        raise FileNotFoundError(f"no metrics.jsonl under {', '.join(map(str, paths))}")
    out_dir = out_dir or (paths[0] / "plots")
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {run: series(run) for run in runs}
    labels = run_labels(runs)
    quantities = sorted({q for s in data.values() for q in s})
    written = []
    for quantity in quantities:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for run, curves in data.items():
            if quantity in curves:
                steps, values = zip(*curves[quantity])
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=labels[run])
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(quantity)
        ax.set_title(quantity)
        ax.grid(alpha=0.3)
        if len(data) > 1:
            ax.legend(fontsize="small")
        fig.tight_layout()
        target = out_dir / f"{quantity}.png"
        fig.savefig(target, dpi=100)
        plt.close(fig)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    """Command line entry."""
    parser = argparse.ArgumentParser(prog="python -m framework.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="run or sweep dirs")
    parser.add_argument("--out", type=Path, help="where to write the PNGs (default: FIRST_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        written = plot(args.dirs, args.out)
    except FileNotFoundError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
