"""Streaming data: is reading, tokenizing and packing a stream fast enough to keep the step fed,
and does a streaming run wait for its data more than a map-style run of the same data?

On the GPT task (`model=gpt data=chars loss=lm`: the standard library's source as characters,
byte tokens, blocks of 64), measured side by side in one process:

* the streaming loader alone: tokens/s a rank's `StreamLoader` hands out (read, tokenized and
  packed on the fly), next to the tokens/s `Engine.fit` consumes: their ratio should be well
  above 1 (the loader is not the bottleneck);
* the step time of `Engine.fit` on the stream (read and packed by one loader worker, beside the
  step) over its step time on the same blocks as a map-style dataset (target <= 1.05: streaming
  costs the step nothing), with the data wait per step of each.

    python -m benchmarks.streams [--quick | --smoke]
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import StepTimes, median, parse_args, print_table, quiet, write

BLOCK = 64


def _documents(chars: int) -> list[dict[str, str]]:
    """The shipped text (the standard library's source) as documents of a few lines each."""
    from framework.data.datasets.chars import stdlib_text

    lines = stdlib_text(chars).splitlines()
    return [{"text": "\n".join(lines[i : i + 8])} for i in range(0, len(lines), 8)]


def _as_pairs(items: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed blocks of BLOCK + 1 tokens as (inputs, next tokens): what the GPT and LMLoss take."""
    ids = torch.from_numpy(np.stack([item["input_ids"] for item in items]))
    return ids[:, :-1], ids[:, 1:]


def _stream(docs: list[dict[str, str]]) -> Any:
    from framework.data.packing import packed
    from framework.data.streams import Stream

    def tokenize(doc: dict[str, str]) -> list[int]:
        return list(doc["text"].encode("utf-8"))

    return Stream(docs, packed(tokenize, BLOCK + 1, eos_id=0), shards=8, collate_fn=_as_pairs)


def loader_rate(docs: list[dict[str, str]], batch: int, seconds: float) -> float:
    """Tokens/s a one-rank StreamLoader of the documents hands out (a pass, or `seconds`)."""
    from framework.data.stream_loader import StreamLoader

    tokens, start = 0, time.perf_counter()
    for x, _ in StreamLoader(_stream(docs), batch, 1, 0):
        tokens += x.numel()
        if time.perf_counter() - start > seconds:
            break
    return tokens / (time.perf_counter() - start)


def _fit(data: Any, batch: int, steps: int, workers: int = 0) -> tuple[list[float], float]:
    """Engine.fit of a small GPT for `steps` steps (`workers` loader workers): per-step times and
    the mean data wait (ms)."""
    from framework import Callback, Engine
    from framework.models import GPT, LMLoss

    waits: list[float] = []

    class Waits(Callback):
        def on_step_end(self, state: Any) -> None:
            if "time_data_ms" in state.logs:
                waits.append(float(state.logs["time_data_ms"]))

    timer = StepTimes()
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=BLOCK, n_layer=2, n_head=2, n_embd=64)
    engine = Engine(
        model, LMLoss(), functools.partial(torch.optim.AdamW, lr=1e-3), callbacks=[timer, Waits()]
    )
    engine.fit(
        data, epochs=1, batch_size=batch, max_steps=steps, shuffle=False, log_freq=5, progress=False,
        num_workers=workers,
    )  # fmt: skip
    engine.close()
    return timer.times, sum(waits) / max(1, len(waits))


def run(chars: int, batch: int, steps: int) -> dict[str, Any]:
    """One side-by-side measurement (see the module doc)."""
    from framework.data.stream_loader import StreamLoader

    docs = _documents(chars)
    blocks = [(x[0], y[0]) for x, y in StreamLoader(_stream(docs), 1, 1, 0)]  # the same blocks, map-style
    rate = loader_rate(docs, batch, seconds=5.0)
    stream_times, stream_wait = _fit(_stream(docs), batch, steps, workers=1)  # tokenizing beside the step
    map_times, map_wait = _fit(blocks, batch, steps)
    stream_step, map_step = median(stream_times), median(map_times)
    consumed = batch * BLOCK / stream_step
    return {
        "blocks": len(blocks),
        "loader_tokens_per_s": rate,
        "fit_tokens_per_s": consumed,
        "loader_over_consumption": rate / consumed,
        "step_ms_stream": stream_step * 1000,
        "step_ms_map": map_step * 1000,
        "stream_over_map": stream_step / map_step,
        "data_wait_ms_stream": stream_wait,
        "data_wait_ms_map": map_wait,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Measure and write results/streams.json."""
    args = parse_args(__doc__, argv)
    quiet()
    chars, batch, steps = (
        (60_000, 8, 6) if args.smoke else (300_000, 16, 30) if args.quick else (600_000, 16, 80)
    )
    rows = [run(chars, batch, steps)]
    print_table("Streaming: loader tokens/s vs what the step consumes; step time stream / map-style", rows)
    write("streams", rows, {"target": "stream_over_map <= 1.05; loader_over_consumption > 1"}, args.out_dir)
    return rows


if __name__ == "__main__":
    main()
