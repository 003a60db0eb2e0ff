"""Run under torchrun: prepare an Engine with ZeRO-3 and write how many parameter elements this
rank holds (DeepSpeed's partitioned-parameter metadata) to OUT_DIR/rank<R>.json."""

import functools
import json
import sys
from pathlib import Path

import torch

from framework import Engine, ProcessContext, Strategy
from framework.backend.runtime import Runtime
from framework.models import MLP

out_dir = Path(sys.argv[1])
# Nothing persistent (whole on every rank), so every parameter must be partitioned.
strategy = Strategy(sharding={"stage": 3, "param_persistence_threshold": 0})
job = ProcessContext.start(timeout_s=60)
runtime = Runtime(strategy, job)
runtime.fix_layout(8)
with runtime.init_context():  # the model is born partitioned
    model = MLP(hidden=[256, 256])
engine = Engine(
    model, torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=1e-3), runtime=runtime
)
engine.prepare("train", batch_size=8)
params = list(engine.module.parameters())
record = {
    "rank": job.rank,
    "world_size": job.world_size,
    "full": sum(p.ds_numel for p in params),
    "local": sum(p.ds_tensor.numel() for p in params),
    "status": sorted({str(p.ds_status) for p in params}),
    "consolidated_keys": len(engine.runtime.full_state_dict()),  # rank 0 only (collective)
    "state_keys": len(engine.module.state_dict()),
}
(out_dir / f"rank{job.rank}.json").write_text(json.dumps(record))
job.close()
