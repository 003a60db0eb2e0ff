"""One side of the fine-tuning benchmark, in its own process (started by benchmarks/finetune.py).

    python -m benchmarks.finetune_worker {hydraspeed,logits,trl} WORK_DIR

WORK_DIR holds the base model (`model/`, save_pretrained), the rows (`rows.json`: token ids and
labels, -100 where the loss does not count) and `job.json` (micro-batch, steps, LoRA rank). The
model is wrapped with the same LoRA adapters (seeded) on every side, trained with AdamW at a
constant learning rate, no weight decay, no clipping, fp32, on the rows in order, padded on the
right as TRL pads them. Prints one JSON line: the loss of every step, the seconds of every step
after the first, and the process's peak RSS.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

LR = 1e-4


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _model(work: Path, rank: int) -> Any:
    """The base model with LoRA on every linear layer but the head, the adapters seeded."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
    torch.manual_seed(1)
    return peft.get_peft_model(base, config)


def collate(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Rows padded on the right to the longest (ids 0, labels -100, mask 0), as TRL's collator pads."""
    width = max(len(r["input_ids"]) for r in rows)
    out: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for r in rows:
        pad = width - len(r["input_ids"])
        out["input_ids"].append(r["input_ids"] + [0] * pad)
        out["attention_mask"].append([1] * len(r["input_ids"]) + [0] * pad)
        out["labels"].append(r["labels"] + [-100] * pad)
    return {k: torch.tensor(v) for k, v in out.items()}


def run_hydraspeed(work: Path, job: dict[str, Any], rows: list[Any], chunked: bool) -> dict[str, Any]:
    """`Engine.fit` with `SFT()` (chunked: the default) on one process, ZeRO-0."""
    import functools

    from framework import Callback, Engine
    from framework.methods import SFT

    losses: list[float] = []
    stamps: list[float] = []

    class Record(Callback):
        def on_step_end(self, state: Any) -> None:
            stamps.append(time.perf_counter())
            if "loss" in state.logs:
                losses.append(float(state.logs["loss"]))

    engine = Engine(
        _model(work, job["rank"]),
        optimizer=functools.partial(torch.optim.AdamW, lr=LR, weight_decay=0.0),
        train_step=SFT(chunked_loss=chunked),
    )
    with engine:
        engine.fit(
            rows,
            batch_size=job["micro_batch"],
            max_steps=job["steps"],
            shuffle=False,
            log_freq=1,
            collate_fn=collate,
            callbacks=[Record()],
            progress=False,
        )
    return {"losses": losses, "step_s": [b - a for a, b in zip(stamps, stamps[1:])]}


def run_trl(work: Path, job: dict[str, Any], rows: list[Any]) -> dict[str, Any]:
    """TRL's `SFTTrainer` with its defaults but for what makes the update the same: fp32, a
    constant learning rate, no weight decay or clipping, the rows in order, logged every step."""
    import datasets
    import transformers
    import trl
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>")), pad_token="<pad>"
    )
    losses: list[float] = []
    stamps: list[float] = []

    class Record(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stamps.append(time.perf_counter())

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class InOrder(trl.SFTTrainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    args = trl.SFTConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=job["micro_batch"],
        max_steps=job["steps"],
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        optim="adamw_torch",
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        max_length=None,
        dataset_kwargs={"skip_prepare_dataset": True},
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = InOrder(
        model=_model(work, job["rank"]),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Record()],
    )
    trainer.train()
    return {"losses": losses, "step_s": [b - a for a, b in zip(stamps, stamps[1:])]}


def main() -> None:
    side, work = sys.argv[1], Path(sys.argv[2])
    job = json.loads((work / "job.json").read_text())
    rows = json.loads((work / "rows.json").read_text())
    torch.set_num_threads(job["threads"])
    if side == "trl":
        out = run_trl(work, job, rows)
    else:
        out = run_hydraspeed(work, job, rows, chunked=side == "hydraspeed")
    out["peak_rss_MB"] = _peak_mb()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
