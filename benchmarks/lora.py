"""LoRA next to full fine-tuning: the same Llama-style model and global batch, ZeRO-3 on 2 processes;
and LoRA with transformers' gradient checkpointing turned on, as users turn it on.

Per setup, in fresh worker processes: peak RSS per rank above the RSS after imports, median step
time (AdamW), and the size of the checkpoint written at the end (every rank's files). LoRA: r=8
on every linear layer but the head (`target_modules="all-linear"`), dropout 0; its checkpoint
holds the adapters and their optimizer states, the full one every weight and its states.

    python -m benchmarks.lora [--quick | --smoke]
"""

from __future__ import annotations

import functools
import resource
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import StepTimes, median, parse_args, print_table, quiet, write

SIZES = {  # hidden, layers, vocab
    "llama25m": (512, 6, 8192),
    "llama_small": (32, 2, 128),
}


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def worker(
    adapter: bool, size: str, steps: int, batch: int, seq: int, checkpointing: bool = False
) -> dict[str, Any]:
    """One setup on every rank; rank 0's numbers are returned. `checkpointing`: transformers'
    gradient checkpointing (non-reentrant), turned on by the user on the model."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from framework import Engine, ProcessContext, Strategy

    quiet()
    job = ProcessContext.start()
    hidden, layers, vocab = SIZES[size]
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=8 if hidden >= 256 else 4, num_key_value_heads=4 if hidden >= 256 else 2,
        max_position_embeddings=seq,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tokens = torch.randint(0, vocab, (batch * (steps + 1), seq), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
    baseline = _rss()
    engine = Engine(
        model, "model", functools.partial(torch.optim.AdamW, lr=1e-4), strategy=Strategy(sharding={"stage": 3}),
        process=job, adapter=lora if adapter else None,
    )  # fmt: skip
    times = StepTimes()
    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(job.broadcast_object(tmp))
        engine.fit(
            data,
            batch_size=batch,
            max_steps=steps + 1,
            callbacks=[times],
            progress=False,
            save_dir=str(saved),
        )
        size_bytes = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
        job.barrier()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters())
    trainable = sum(
        int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters() if p.requires_grad
    )
    engine.close()
    return {
        "model": size,
        "setup": ("LoRA r=8 ZeRO-3" if adapter else "full ZeRO-3")
        + (" + checkpointing" if checkpointing else ""),
        "params_M": total / 1e6,
        "trainable_M": trainable / 1e6,
        "peak_minus_baseline_MB": (peak - baseline) / 2**20,
        "step_ms": median(times.times or [float("nan")]) * 1000,
        "checkpoint_MB": size_bytes / 2**20,
    }


def measure(
    adapter: bool, size: str, steps: int, batch: int, seq: int, nproc: int = 2, checkpointing: bool = False
) -> dict[str, Any]:
    """A setup in `nproc` fresh worker processes."""
    from framework.process.launch import spawn

    args = (adapter, size, steps, batch, seq, checkpointing)
    return {**spawn(worker, args, nproc), "ranks": nproc, "global_batch": batch}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Both setups, side by side; the LoRA row carries its ratios to the full one."""
    args = parse_args(__doc__, argv)
    size, steps, batch, seq = (
        ("llama_small", 2, 4, 16) if args.smoke else ("llama25m", 4 if args.quick else 8, 8, 128)
    )
    full, lora = (measure(adapter, size, steps, batch, seq) for adapter in (False, True))
    for key in ("peak_minus_baseline_MB", "step_ms", "checkpoint_MB"):
        lora[f"{key}_lora_over_full"] = lora[key] / full[key] if full[key] else float("nan")
    checkpointed = measure(True, size, steps, batch, seq, checkpointing=True)
    for key in ("peak_minus_baseline_MB", "step_ms"):
        checkpointed[f"{key}_over_lora"] = checkpointed[key] / lora[key] if lora[key] else float("nan")
    rows = [full, lora, checkpointed]
    print_table("LoRA vs full fine-tuning, ZeRO-3, 2 processes; LoRA with gradient checkpointing", rows)
    write(
        "lora",
        rows,
        {
            "optimizer": "AdamW (torch), fp32",
            "peak_minus_baseline_MB": "rank 0's peak RSS above its RSS after imports",
            "checkpoint_MB": "every rank's files of the checkpoint written at the end",
        },
        args.out_dir,
    )
    return rows


if __name__ == "__main__":
    main()
