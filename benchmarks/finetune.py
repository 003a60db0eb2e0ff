"""Fine-tuning next to TRL: the same LoRA SFT job with hydraspeed's `SFT()` and TRL's `SFTTrainer`.

The job of issue 50: a Llama with a 128,256-token vocabulary (hidden 256, 2 layers), LoRA r=8 on
every linear layer but the head, micro-batches of 2 rows of ~1.9 k tokens (about half of them
labelled), AdamW, fp32, one process on the CPU. Each side runs in a fresh process, the sides
alternating, on the same weights, adapters and batches (`benchmarks.finetune_worker`): the losses
of every step must agree (TRL logs them to 4 decimals), and the rows report peak RSS, the median
step time and real (unpadded) tokens per second, with ratios to TRL's measured in the same run.
hydraspeed runs twice: as it is (its head scores the labelled positions in chunks) and with
`chunked_loss=False` (from the full logits, as before). TRL comes from the `bench` extra; without
it only hydraspeed's rows are measured.

    python -m benchmarks.finetune [--quick | --smoke]
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import median, parse_args, print_table, write

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"hydraspeed": "hydraspeed", "hydraspeed, chunked_loss=false": "logits", "TRL SFTTrainer": "trl"}
SIZES = {  # vocabulary, hidden, layers, tokens per row (about), steps, repeats
    "smoke": (2048, 32, 2, 96, 3, 1),
    "quick": (128256, 256, 2, 1900, 5, 1),
    "full": (128256, 256, 2, 1900, 5, 2),
}


def prepare(work: Path, vocab: int, hidden: int, layers: int, length: int, steps: int) -> int:
    """The base model and the rows (2 per step: a conversation of user and assistant turns, only
    the assistant's labelled) into `work`; the real tokens of the steps after the first."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=8 if hidden >= 256 else 4,
        num_key_value_heads=4 if hidden >= 256 else 2,
        max_position_embeddings=2 * length,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(work / "model")
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(2 * steps):
        size = length - int(torch.randint(0, max(2, length // 20), (), generator=g))
        ids = torch.randint(2, vocab, (size,), generator=g)
        labels = torch.full_like(ids, -100)
        start = 0
        while start < size:  # turns of ~length/8 tokens: user, then assistant (labelled)
            turn = max(4, length // 8 + int(torch.randint(-length // 32, length // 32 + 1, (), generator=g)))
            labels[start + turn : start + 2 * turn] = ids[start + turn : start + 2 * turn]
            start += 2 * turn
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    (work / "rows.json").write_text(json.dumps(rows))
    return sum(len(r["input_ids"]) for r in rows[2:])


def run(side: str, work: Path) -> dict[str, Any]:
    """One side in a fresh process."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.finetune_worker", side, str(work)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{side}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Every side, alternating, `repeats` times; one row per side."""
    args = parse_args(__doc__, argv)
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    vocab, hidden, layers, length, steps, repeats = SIZES[size]
    sides = {name: side for name, side in SIDES.items() if side != "trl" or importlib.util.find_spec("trl")}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokens = prepare(work, vocab, hidden, layers, length, steps)
        job = {"micro_batch": 2, "steps": steps, "rank": 8, "threads": torch.get_num_threads()}
        (work / "job.json").write_text(json.dumps(job))
        for _ in range(repeats):
            for name, side in sides.items():
                results[name].append(run(side, work))
    trl = results.get("TRL SFTTrainer")
    rows = []
    for name, runs in results.items():
        peak = median([r["peak_rss_MB"] for r in runs])
        step = median([t for r in runs for t in r["step_s"]])
        row: dict[str, Any] = {
            "framework": name,
            "peak_rss_MB": peak,
            "step_s": step,
            "tokens_per_s": tokens / (step * (steps - 1)),
            "rss_over_trl": None,
            "step_time_over_trl": None,
            "max_loss_diff": None,
        }
        if trl:
            row["rss_over_trl"] = peak / median([r["peak_rss_MB"] for r in trl])
            row["step_time_over_trl"] = step / median([t for r in trl for t in r["step_s"]])
            if any(len(r["losses"]) != len(trl[0]["losses"]) for r in runs):
                raise RuntimeError(
                    f"{name} logged {len(runs[0]['losses'])} losses, TRL {len(trl[0]['losses'])}"
                )
            row["max_loss_diff"] = max(
                abs(a - b) for r in runs for a, b in zip(r["losses"], trl[0]["losses"])
            )
        rows.append(row)
    print_table(f"LoRA SFT next to TRL's SFTTrainer, vocabulary {vocab:,}, 1 process", rows)
    notes = {
        "job": f"Llama vocab {vocab}, hidden {hidden}, {layers} layers; LoRA r=8 all-linear; 2 rows of ~{length} "
        f"tokens per step; {steps} steps (the first untimed); AdamW lr 1e-4, fp32; {repeats} run(s) per side",
        "trl": "SFTTrainer defaults (its fused LM head, gradient checkpointing) but fp32, a constant lr, no "
        "weight decay or clipping, rows in order, logging every step (losses to 4 decimals)",
        "max_loss_diff": "largest difference to TRL's loss at any step",
        "missing": [] if trl else ["trl"],
    }
    write("finetune", rows, notes, args.out_dir)
    return rows


if __name__ == "__main__":
    main()
