"""Run under torchrun: resume onto another number of processes, one case after another in one
process tree (each case a ZeRO stage and an optimizer).

    resize_resume.py OUT full CASE...    train each case 2 epochs from scratch, a checkpoint every
                                         SAVE_FREQ steps; write OUT/CASE/full.pt (weights, history)
    resize_resume.py OUT resume CASE...  continue each case from its first checkpoint on this
                                         number of processes; write OUT/CASE/resumed.pt

A case is [tp-]STAGE-OPTIMIZER: zero1-adamw, zero2-sgd (momentum 0.9), zero3-sgd0 (no momentum),
tp-zero1-sgd (saved tensor parallel over the 2 ranks, resumed without), ...
The epoch aggregates are the framework's accuracy and torchmetrics' (merged with `merge_state`).
"""

import functools
import sys
from pathlib import Path

import torch
from torchmetrics.classification import MulticlassAccuracy

from framework import Engine, ProcessContext, Strategy
from framework.data.datasets import synthetic
from framework.models import MLP
from framework.observe.metrics import Accuracy

OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=3e-3),
    "adam": functools.partial(torch.optim.Adam, lr=3e-3),
    "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
    "sgd0": functools.partial(torch.optim.SGD, lr=0.1),
}
SAVE_FREQ = 5
BATCH = 32


def run(out: Path, phase: str, case: str, job: ProcessContext) -> None:
    *tp, stage, optimizer = case.split("-")  # tp-zero1-sgd: tensor parallel over 2 ranks, then 1
    split = {"degree": 2, "plan": {"features.0": "column", "head": "row"}} if tp and phase == "full" else {}
    data = synthetic(num_samples=320, num_features=16, num_classes=4)
    torch.manual_seed(0)
    engine = Engine(
        MLP(in_features=16, hidden=[32], num_classes=4),
        torch.nn.CrossEntropyLoss(),
        OPTIMIZERS[optimizer],
        {"accuracy": Accuracy(), "tm_accuracy": MulticlassAccuracy(num_classes=4, average="micro")},
        strategy=Strategy(sharding={"stage": int(stage[-1])}, tensor_parallel=split),
        process=job,
    )
    ckpts = out / case / "checkpoints"
    options = dict(
        epochs=2, batch_size=BATCH, log_freq=1, save_freq=SAVE_FREQ, keep_last_k=None, progress=False
    )
    if phase == "full":
        history = engine.fit(data.train, data.valid, save_dir=str(ckpts), **options)
    else:
        first = sorted(p for p in ckpts.iterdir() if p.name.startswith("step_") and p.name[5:].isdigit())[0]
        history = engine.fit(
            data.train, data.valid, save_dir=str(out / case / "resumed"), resume=str(first), **options
        )
    weights = engine.runtime.full_state_dict()  # collective; whole on rank 0
    if job.is_main:
        torch.save({"weights": weights, "history": history}, out / case / f"{phase}.pt")


if __name__ == "__main__":
    out_dir, phase_name = Path(sys.argv[1]), sys.argv[2]
    context = ProcessContext.start(timeout_s=120)  # one group for every engine
    for name in sys.argv[3:]:
        run(out_dir, phase_name, name, context)
    context.close()
