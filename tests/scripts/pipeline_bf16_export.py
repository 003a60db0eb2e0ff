"""Run under torchrun (2 processes): train a 2-stage GPT pipeline in bf16 for a few steps, save
the consolidated weights, and write to OUT_DIR/rank0.json whether they are the fp32 masters."""

import functools
import json
import sys
from pathlib import Path

import torch

from framework import Engine, Strategy
from framework.backend.weights import load_weights
from framework.models import GPT, LMLoss

out_dir = Path(sys.argv[1])
torch.manual_seed(0)
strategy = Strategy(pipeline={"stages": 2, "accumulate_steps": 2}, amp={"enable": True, "dtype": "bf16"})
engine = Engine(
    GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32),
    LMLoss(),
    functools.partial(torch.optim.AdamW, lr=1e-3),
    strategy=strategy,
)
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, 32, (64, 17), generator=g)
engine.fit(torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]), epochs=1, batch_size=16, log_freq=1000)
engine.save(str(out_dir / "w.safetensors"), training=False)
if engine.process.is_main:
    saved = load_weights(out_dir / "w.safetensors")
    rounded = [k for k, v in saved.items() if v.dim() == 2 and torch.equal(v, v.bfloat16().float())]
    record = {"keys": len(saved), "matrices": sum(v.dim() == 2 for v in saved.values()), "rounded": rounded}
    (out_dir / "rank0.json").write_text(json.dumps(record))
engine.close()
