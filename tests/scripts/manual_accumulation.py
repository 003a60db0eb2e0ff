"""Run under torchrun (or alone): for every ZeRO stage, two `engine.backward` calls then one
`engine.step` must give the same parameters as plain torch on the averaged loss over the
global batch. Writes OUT_DIR/rank<R>.json with the max error per stage."""

import copy
import functools
import json
import sys
from pathlib import Path

import torch

from framework import Engine, ProcessContext, Strategy
from framework.models import MLP

out_dir = Path(sys.argv[1])
torch.manual_seed(0)
base = MLP(hidden=[32])
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
loss_fn = torch.nn.CrossEntropyLoss()

reference = copy.deepcopy(base)
opt = torch.optim.SGD(reference.parameters(), lr=0.5)
for _ in range(2):
    opt.zero_grad()
    loss_fn(reference(x), y).backward()  # the whole global batch of 32
    opt.step()

errors = {}
job = ProcessContext.start(timeout_s=60)  # one group for all stages: re-creating one under torchrun can hang
rank, world = job.rank, job.world_size
for stage in (0, 1, 2, 3):
    mine = slice(rank * 32 // world, (rank + 1) * 32 // world)  # this rank's 32 / world samples
    xs, ys = x[mine], y[mine]
    half = len(xs) // 2
    engine = Engine(
        copy.deepcopy(base),
        loss_fn,
        functools.partial(torch.optim.SGD, lr=0.5),
        strategy=Strategy(sharding={"stage": stage}),
        process=job,
    )
    engine.prepare("train", batch_size=half * world)
    for _ in range(2):
        engine.backward(engine.loss(engine.model(xs[:half]), ys[:half]) / 2)
        engine.backward(engine.loss(engine.model(xs[half:]), ys[half:]) / 2)
        engine.step()
    state = engine.runtime.full_state_dict(on_every_rank=True)
    errors[stage] = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
job.close()
(out_dir / f"rank{rank}.json").write_text(json.dumps(errors))
