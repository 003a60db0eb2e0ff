"""Run under torchrun (or alone): predict with the default step, a batch predict step (a model
method) and an iterator predict step that pulls two batches per call, over a dataset that does
not divide into the ranks' batches (the last ones are padded). Rank 0 writes OUT_DIR/predict.json:
how each result compares with the plain model's outputs in dataset order."""

import functools
import json
import sys
from pathlib import Path

import torch

from framework import Engine
from framework.data.datasets import synthetic
from framework.models import MLP


class WithPredictStep(MLP):
    def predict_step(self, batch):
        return self(batch[0]).softmax(-1)  # something other than the default, to see it was used


def two_batches(engine, dataloader_iter):
    first = next(dataloader_iter)
    outputs = [engine.model(first[0])]
    try:
        outputs.append(engine.model(next(dataloader_iter)[0]))
    except StopIteration:  # the first batch was this rank's last
        pass
    return torch.cat(outputs)


out_dir = Path(sys.argv[1])
valid = synthetic(num_samples=125).valid  # 25 samples
torch.manual_seed(0)
model = WithPredictStep(hidden=[32])
x = torch.stack([valid[i][0] for i in range(len(valid))])
with torch.no_grad():
    expected = model(x)
results = {}
for name, kwargs in {"default": {}, "iterator": {"predict_step": two_batches}}.items():
    engine = Engine(model, torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), **kwargs)
    if name == "default":
        engine.predict_step_fn = None  # the model's predict_step aside: the framework's model(x)
    out = torch.cat(engine.predict(valid, batch_size=4))
    results[name] = bool(out.shape == expected.shape and torch.allclose(out, expected, atol=1e-6))
engine = Engine(model, torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1))
out = torch.cat(engine.predict(valid, batch_size=4))
results["model method"] = bool(torch.allclose(out, expected.softmax(-1), atol=1e-6))
results["world_size"] = engine.process.world_size
if engine.process.is_main:
    (out_dir / "predict.json").write_text(json.dumps(results))
engine.close()
