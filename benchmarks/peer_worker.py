"""One framework training one task, in its own process (started by benchmarks/peers.py).

    python -m benchmarks.peer_worker {hydraspeed,plain,lightning,accelerate} {mlp,gpt} STEPS

Prints one JSON line: seconds from process start (BENCH_T0) to the end of the first step,
and samples/s over the steps after warm-up.
"""

from __future__ import annotations

import json
import os
import sys
import time

T0 = float(os.environ.get("BENCH_T0", time.time()))


def task(name: str):
    """Model, loss, dataset and global batch of a task (same for every framework)."""
    import torch

    from framework.models import GPT, MLP, LMLoss

    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        n, batch = 64 * 200, 64
        data = torch.utils.data.TensorDataset(
            torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g)
        )
        return MLP(256, [1024, 1024], 10), torch.nn.CrossEntropyLoss(), data, batch
    n, batch = 32 * 200, 32
    ids = torch.randint(0, 128, (n, 65), generator=g)
    data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
    return GPT(), LMLoss(), data, batch


def report(first_step_end: float, stamps: list[float], batch: int) -> None:
    """Print the JSON line: throughput from the median step interval after three warm-up steps
    (a median, as the other benchmarks use: one step the OS or the GC stalls does not move it)."""
    warm = stamps[3:]
    intervals = sorted(b - a for a, b in zip(warm, warm[1:]))
    rate = batch / intervals[len(intervals) // 2] if intervals else float("nan")
    print(json.dumps({"first_step_s": first_step_end - T0, "samples_per_s": rate}))


def run_hydraspeed(name: str, steps: int) -> None:
    import functools

    import torch

    from framework import Callback, Engine

    model, loss, data, batch = task(name)
    stamps: list[float] = []

    class Stamp(Callback):
        def on_step_end(self, state):
            stamps.append(time.time())

    engine = Engine(model, loss, functools.partial(torch.optim.AdamW, lr=1e-3), callbacks=[Stamp()])
    engine.fit(data, epochs=1, batch_size=batch, max_steps=steps, log_freq=10**9, progress=False)
    engine.close()
    report(stamps[0], stamps, batch)


def run_plain(name: str, steps: int) -> None:
    """The floor: a plain PyTorch loop (no framework) on the same model, data and optimizer."""
    import torch

    model, loss, data, batch = task(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stamps: list[float] = []
    for i, (x, y) in enumerate(torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True)):
        if i >= steps:
            break
        optimizer.zero_grad(set_to_none=True)
        value = loss(model(x), y)
        value.backward()
        optimizer.step()
        value.item()
        stamps.append(time.time())
    report(stamps[0], stamps, batch)


def run_lightning(name: str, steps: int) -> None:
    import lightning as L
    import torch

    model, loss, data, batch = task(name)
    stamps: list[float] = []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, b, i):
            x, y = b
            return loss(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Stamp(L.Callback):
        def on_train_batch_end(self, *args, **kwargs):
            stamps.append(time.time())

    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy="ddp", max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Stamp()],
    )  # fmt: skip
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True))
    report(stamps[0], stamps, batch)


def run_accelerate(name: str, steps: int) -> None:
    import torch
    from accelerate import Accelerator

    model, loss, data, batch = task(name)
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    stamps: list[float] = []
    for i, (x, y) in enumerate(loader):
        if i >= steps:
            break
        optimizer.zero_grad()
        value = loss(model(x), y)
        accelerator.backward(value)
        optimizer.step()
        value.item()
        stamps.append(time.time())
    report(stamps[0], stamps, batch)


if __name__ == "__main__":
    framework_name, task_name, n_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    runners = {
        "hydraspeed": run_hydraspeed,
        "plain": run_plain,
        "lightning": run_lightning,
        "accelerate": run_accelerate,
    }
    runners[framework_name](task_name, n_steps)
