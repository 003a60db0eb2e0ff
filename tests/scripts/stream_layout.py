"""Run under torchrun (any number of processes), or call `train` in a process: train an MLP on the
digits written as a JSONL file and read back as a Hugging Face stream (`load_dataset("json", ...,
streaming=True)`), shuffled, under max_steps, saving a checkpoint every `save_freq` steps (or
resuming one). It returns (and, as a script, each rank writes to OUT/rank<R>.json) the sample ids
this rank trained on, in order, and the final weights."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch

from framework import Engine, ProcessContext
from framework.data.streams import Stream
from framework.models import MLP


class Recorded(MLP):
    """An MLP fed dict batches (`model(**batch)`), noting the ids of the samples it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, id: torch.Tensor) -> torch.Tensor:  # noqa: A002 - the JSON field
        if self.training:
            self.seen += id.tolist()
        return super().forward(x)


def stream(corpus: Path) -> Stream:
    """The JSONL corpus as the stream every run here reads."""
    import datasets

    datasets.disable_progress_bars()
    data = datasets.load_dataset("json", data_files=str(corpus), split="train", streaming=True)
    return Stream(data, shards=8, shuffle_window=64, seed=7)


def train(corpus: Path, out: Path, steps: int, save_freq: int, workers: int, resume: str | None = None,
          process: ProcessContext | None = None) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(0)
    model = Recorded()
    engine = Engine(model, torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), label_key="y",
                    process=process)  # fmt: skip
    engine.fit(
        stream(corpus), epochs=1, batch_size=32, max_steps=steps, num_workers=workers, resume=resume,
        save_dir=str(out / "checkpoints"), save_freq=save_freq, progress=False,
    )  # fmt: skip
    weights = {k: v.tolist() for k, v in engine.runtime.full_state_dict(on_every_rank=True).items()}
    return {"seen": model.seen, "weights": weights}


if __name__ == "__main__":
    corpus, out, steps, save_freq, workers = Path(sys.argv[1]), Path(sys.argv[2]), *map(int, sys.argv[3:6])
    job = ProcessContext.start(timeout_s=120)
    result = train(corpus, out, steps, save_freq, workers, process=job)
    (out / f"rank{job.rank}.json").write_text(json.dumps(result))
    job.close()
