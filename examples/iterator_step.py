"""Iterator-consuming training steps: the step pulls as many batches as it wants.

    python examples/iterator_step.py two_batch     # two micro-batches per optimizer step, automatic
    python examples/iterator_step.py tbptt         # truncated BPTT: a GRU over 4 consecutive chunks
    torchrun --nproc-per-node=2 examples/iterator_step.py tbptt --stage 2

The framework counts every batch a step fetches (progress, metrics.jsonl, resume) and hands
them over already on the device, prefetched in the background. The same functions work from
the config: `python train.py 'step={_target_:examples.iterator_step.two_batch_step,_partial_:true}'`.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from framework import Engine, Strategy
from framework.data.datasets import digits
from framework.data.datasets.chars import VOCAB_SIZE, encode, stdlib_text
from framework.models import MLP


def two_batch_step(engine: Engine, dataloader_iter: Iterator[Any]) -> torch.Tensor:
    """Average the loss of two micro-batches; the framework does backward + optimizer step."""
    (x1, y1), (x2, y2) = next(dataloader_iter), next(dataloader_iter)
    return (engine.loss(engine.model(x1), y1) + engine.loss(engine.model(x2), y2)) / 2


# ----------------------------------------------------------------------------- TBPTT


class StreamChunks(Dataset):
    """`streams` parallel streams of text cut into `block`-character chunks, laid out so that
    item i of batch t+1 continues item i of batch t (read in order with batch size `streams`)."""

    def __init__(self, ids: torch.Tensor, block: int, streams: int):
        self.block, self.streams = block, streams
        self.steps = (len(ids) - 1) // (block * streams)
        self.ids = ids[: self.steps * block * streams + 1]
        self.stream_len = self.steps * block

    def __len__(self) -> int:
        return self.steps * self.streams

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        t, stream = divmod(i, self.streams)
        start = stream * self.stream_len + t * self.block
        chunk = self.ids[start : start + self.block + 1]
        return chunk[:-1], chunk[1:]


class CharGRU(nn.Module):
    """A character-level GRU that carries its hidden state between calls (`self.state`)."""

    def __init__(self, vocab: int = VOCAB_SIZE, hidden: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)
        self.state: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits for each position; the final hidden state is kept (detached) for the next chunk."""
        out, state = self.gru(self.embed(idx), self.state)
        self.state = state.detach()
        return self.head(out)


def two_batch_eval_step(engine: Engine, dataloader_iter: Iterator[Any]) -> torch.Tensor:
    """Validation in the same flavour: the mean loss of up to two batches per call (the last call
    of a shard may find only one)."""
    batches = [next(dataloader_iter)]
    try:
        batches.append(next(dataloader_iter))
    except StopIteration:
        pass
    return torch.stack([engine.loss(engine.model(x), y) for x, y in batches]).mean()


def tbptt_step(engine: Engine, dataloader_iter: Iterator[Any], chunks: int = 4) -> dict[str, float]:
    """Truncated backpropagation through time: run `chunks` consecutive chunks, carrying the
    hidden state, backpropagate each, then take one optimizer step (manual optimisation)."""
    engine.module.state = None
    losses = []
    for _ in range(chunks):
        x, y = next(dataloader_iter)
        logits = engine.model(x)
        loss = engine.loss(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / chunks
        engine.backward(loss)
        losses.append(float(loss) * chunks)
    engine.step()
    return {"loss": sum(losses) / len(losses)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("flavour", choices=["two_batch", "tbptt"])
    parser.add_argument("--stage", type=int, default=0, help="ZeRO stage")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--out", help="write the run's counters and losses here as JSON")
    args = parser.parse_args()
    torch.manual_seed(0)
    strategy = Strategy(sharding={"stage": args.stage})
    if args.flavour == "two_batch":
        train, valid = digits()
        engine = Engine(
            MLP(), nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=3e-3),
            strategy=strategy, train_step=two_batch_step,
        )  # fmt: skip
        history = engine.fit(train, valid, epochs=args.epochs, batch_size=64, max_steps=args.max_steps)
    else:
        ids = encode(stdlib_text(200_000))
        engine = Engine(
            CharGRU(), nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=3e-3),
            strategy=strategy, train_step=tbptt_step,
        )  # fmt: skip
        streams = 16 * engine.dp_size  # each data-parallel rank carries 16 streams
        # In order (shuffle=False): consecutive batches continue the same streams.
        history = engine.fit(
            StreamChunks(ids, 32, streams), epochs=args.epochs, batch_size=streams, shuffle=False,
            max_steps=args.max_steps, log_freq=20,
        )  # fmt: skip
    st = engine.state
    result = {
        "step_calls": st.step_calls,
        "optimizer_steps": st.global_step,
        "batches_fetched": st.batches_fetched,
        "loss": history["loss"],
    }
    if engine.process.is_main:
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    engine.close()


if __name__ == "__main__":
    main()
