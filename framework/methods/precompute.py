"""Reference log-probabilities computed once before training and kept with the pairs (DPO's
`precompute_reference`): no reference model is held while training, and a model too large to
copy still has a reference.

The pairs' batches are shared out over the data-parallel ranks and the results gathered; every
rank makes the same number of forward passes (under ZeRO-3 they are collective), one that has
run out repeating its last. Map-style data only: a stream has nowhere to keep them.
"""

from __future__ import annotations

from typing import Any

import torch

from framework.data.outputs import takes_use_cache
from framework.errors import ConfigError
from framework.methods.pairs import pair_stats

REFERENCE_KEYS = ("reference_chosen_logps", "reference_rejected_logps")


@torch.no_grad()
def with_reference_logps(
    engine: Any,
    dataset: Any,
    batch_size: int,
    collate_fn: Any,
    average: bool = False,
    chunk_size: int | None = None,
) -> Any:
    """`dataset` with each pair's reference log-probabilities (means over answer tokens when
    `average`), computed now by the model as it is, `batch_size` pairs per forward pass
    (`chunk_size`: scored through the head in chunks, see `framework.methods.tokens.score_answers`)."""
    if not hasattr(dataset, "__len__"):
        raise ConfigError(
            "precompute_reference=True stores log-probabilities with map-style data, not a stream: read the "
            "data whole (data.dataset.streaming=false), or keep a frozen reference (precompute_reference=False)"
        )
    engine.prepare("train")
    runtime = engine.runtime
    starts = list(range(0, len(dataset), batch_size))
    mine = starts[runtime.mesh.dp_rank :: runtime.mesh.dp_size]
    calls = -(-len(starts) // runtime.mesh.dp_size)
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    was_training = runtime.training
    runtime.train(False)
    try:
        for call in range(calls):
            start = mine[min(call, len(mine) - 1)] if mine else 0
            rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
            batch = engine.transfer(collate_fn(rows))
            chosen, rejected = pair_stats(
                engine.model, batch, engine.output_key, takes_use_cache(engine.module), chunk_size=chunk_size
            )
            pick = (lambda s: s.average()) if average else (lambda s: s.logps)
            done[start] = (pick(chosen).cpu(), pick(rejected).cpu())
    finally:
        runtime.train(was_training)
    for part in runtime.process.all_gather_object(done if mine else {}):
        done.update(part)
    if not starts:
        return WithReference(dataset, torch.zeros(0), torch.zeros(0))
    chosen_all, rejected_all = zip(*(done[start] for start in starts))
    return WithReference(dataset, torch.cat(chosen_all), torch.cat(rejected_all))


class WithReference(torch.utils.data.Dataset):
    """A dataset of pairs whose rows also hold their reference log-probabilities."""

    def __init__(self, dataset: Any, chosen: torch.Tensor, rejected: torch.Tensor):
        self.dataset, self.chosen, self.rejected = dataset, chosen, rejected

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.dataset[i], REFERENCE_KEYS[0]: self.chosen[i], REFERENCE_KEYS[1]: self.rejected[i]}
