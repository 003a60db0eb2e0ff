"""Layout invariance: one optimizer step's loss is the mean over the items of its whole global batch.

DeepSpeed averages a step's micro-batch losses (1 / accumulation steps) and its gradients over
the data-parallel ranks. For a loss that is a mean over *counted items* (tokens whose label is
not -100, as in Hugging Face's causal-LM loss and `loss=lm`), that average of per-micro-batch
means weighs a short sequence's tokens more than a long one's, and the update then depends on
how the global batch was laid out over ranks and accumulation steps. Like Hugging Face's
`num_items_in_batch` and torchtitan, the framework counts the items of the whole global batch
before the step's first backward pass and scales each micro-batch's loss so that the update,
and the logged loss, is the sum over items divided by that global count:

    micro-batch loss x  n_micro x ranks x accumulation / N_global     (a loss that averages)
    micro-batch loss x            ranks x accumulation / N_global     (a loss with reduction="sum")

where ranks are the data-parallel x sequence-parallel ranks (each of the latter holds a slice of
every sequence and counts its own items; tensor-parallel ranks hold the same items).

Which losses count items: `loss=model` (labels != -100; shifted by one for a causal LM, as its
loss is, unless the batch gives Hugging Face's pre-shifted `shift_labels`), a loss function with an `ignore_index` (`torch.nn.CrossEntropyLoss`, `NLLLoss`,
the framework's `LMLoss`) and integer labels, and any loss with `reduction == "sum"` (items:
labels != -100 for integer labels, else samples). Other losses average over samples, and every
training micro-batch holds the same number of samples, so they need no weight; nor does one
micro-batch per step on one data-parallel rank (its own mean is the global batch's). The counts
are device tensors all-reduced without a host sync and without waiting: the all-reduce is
started when the step's micro-batches are known and awaited after the first forward pass, when
the first weight is needed (measured by `benchmarks.exactness`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from framework.backend import sequence_parallel
from framework.data.labels import IGNORE_INDEX
from framework.data.outputs import is_model_loss, split
from framework.integrations.hf import predicts_next_token
from framework.plan.run_plan import Mesh


def _loss_fn(loss: Any) -> Any:
    return getattr(loss, "fn", loss)  # a steps.LossFunction wraps the configured callable


def reduction_of(loss: Any) -> str | None:
    """How `loss` reduces: "mean" over counted items, "sum", or None (a mean over samples, or
    unknown: no weighting)."""
    if loss is None:
        return None
    if is_model_loss(loss):
        return "mean"
    fn = _loss_fn(loss)
    reduction = getattr(fn, "reduction", None)
    if reduction == "sum":
        return "sum"
    if reduction in (None, "mean") and hasattr(fn, "ignore_index"):
        return "mean"
    return None


def counted_items(labels: Any, loss: Any, module: Any, shifted: bool = False) -> torch.Tensor | None:
    """The items of one micro-batch `loss` averages (or sums) over, as a 0-d tensor on the
    labels' device, or None when the loss needs no weighting. `shifted`: the labels are already
    aligned with the positions that predict them (Hugging Face's `shift_labels`)."""
    reduction = reduction_of(loss)
    if reduction is None or not isinstance(labels, torch.Tensor):
        return None
    if labels.is_floating_point():
        if reduction == "mean":
            return None
        return torch.tensor(float(labels.shape[0]), device=labels.device)
    ignore = getattr(_loss_fn(loss), "ignore_index", IGNORE_INDEX)
    if is_model_loss(loss) and predicts_next_token(module) and labels.dim() > 1 and not shifted:
        labels = labels[..., 1:]  # a causal LM scores position t against label t + 1
    return (labels != ignore).sum().to(torch.float64)


def _items_of(batch: Any, loss: Any, module: Any, label_key: str) -> torch.Tensor | None:
    shifted = batch.get("shift_labels") if isinstance(batch, Mapping) and is_model_loss(loss) else None
    if isinstance(shifted, torch.Tensor):  # what a Hugging Face model's loss scores, as given
        return counted_items(shifted, loss, module, shifted=True)
    return counted_items(split(batch, label_key)[2], loss, module)


class _Window:
    """The weights of one or more consecutive optimizer steps, from one all-reduce of their global
    item counts that is started at once and awaited when a weight is first needed; then every
    step's weights are computed together (a handful of tensor operations for the whole window)."""

    def __init__(
        self,
        locals_: list[torch.Tensor],
        totals: torch.Tensor,
        work: Any,
        copies: int,
        ranks: int,
        summed: bool,
    ):
        self._locals, self._totals, self._work = locals_, totals, work
        self._copies, self._ranks, self._summed = copies, ranks, summed
        self._weights: list[list[torch.Tensor]] | None = None

    def settle(self) -> None:
        """Finish the all-reduce."""
        if self._work is not None:
            self._work.wait()
            self._work = None

    def count(self, step: int) -> float:
        """The global item count of the window's `step`-th optimizer step (reads it to the host)."""
        self.settle()
        return float(self._totals[step].item()) / self._copies

    def weights(self, step: int) -> list[torch.Tensor]:
        """The micro-batch weights of the window's `step`-th optimizer step."""
        if self._weights is None:
            self.settle()
            device = self._locals[0].device
            sizes = [len(local) for local in self._locals]
            lengths = torch.tensor(sizes, dtype=torch.float64, device=device)
            totals = (self._totals.to(device) / self._copies).clamp_min(1.0)
            scales = (self._ranks * lengths / totals).repeat_interleave(torch.tensor(sizes, device=device))
            flat = scales if self._summed else torch.cat(self._locals) * scales
            self._weights = [list(part.unbind()) for part in flat.to(torch.float32).split(sizes)]
        return self._weights[step]


class StepWeights(Sequence[torch.Tensor]):
    """The weights of one optimizer step's micro-batches, whose global item count may still be in
    flight: the first weight read waits for it, so the all-reduce runs while the first
    micro-batch's forward pass does and no rank stalls in it before its step begins."""

    def __init__(self, window: _Window, step: int, size: int, weighted: bool = True):
        self._window, self._step, self._size = window, step, size
        self.weighted = weighted  # False: the step's losses need no weight (counted for the logs only)

    def weight(self, i: int) -> Any:
        """A zero-argument call giving micro-batch `i`'s weight, or None when it needs none."""
        return functools.partial(self.__getitem__, i) if self.weighted else None

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, i: Any) -> Any:
        return self._window.weights(self._step)[i]

    def settle(self) -> None:
        """Finish the count's all-reduce (a step the epoch's end left unused still took part in it)."""
        self._window.settle()

    def items(self) -> float:
        """The items (e.g. counted tokens) of this optimizer step's whole global batch."""
        return self._window.count(self._step)


def window_weights(
    steps: Sequence[Sequence[Any]],
    loss: Any,
    module: Any,
    label_key: str,
    mesh: Mesh,
    device: torch.device | None = None,
) -> list[StepWeights] | None:
    """`step_weights` of several consecutive optimizer steps (each a list of micro-batches) with
    one all-reduce of their counts: a collective costs the host the same for one count or many,
    and on the CPU (gloo) each costs a step about as much as the counting it serves. Collective:
    every rank calls it at the same point with the same number of steps."""

    def count(batch: Any) -> torch.Tensor | None:
        if mesh.sp_size > 1:
            batch = sequence_parallel.shard(batch, mesh, label_key)
        return _items_of(batch, loss, module, label_key)

    summed = reduction_of(loss) == "sum"
    if reduction_of(loss) is None:
        return None
    return counted_windows(steps, count, mesh, summed, device)


def counted_windows(
    steps: Sequence[Sequence[Any]],
    count: Any,
    mesh: Mesh,
    summed: bool = False,
    device: torch.device | None = None,
) -> list[StepWeights] | None:
    """The weights of several consecutive optimizer steps' micro-batches for a loss that averages
    (or, `summed`, sums) over the items `count(batch)` gives (a 0-d tensor, or None: no
    weighting): the framework's default loss, or a method's `items` (`framework.methods`).
    Collective (see `window_weights`)."""
    ranks, copies = mesh.dp_size * mesh.sp_size, mesh.tp_size  # whose losses add up; who holds an item
    # one micro-batch on one rank: its mean is the global batch's (no weight), its count the step's
    alone = ranks == 1 and not summed and all(len(step) == 1 for step in steps)
    locals_: list[torch.Tensor] = []
    for micro_batches in steps:
        counts = [count(batch) for batch in micro_batches]
        if not counts or any(c is None for c in counts):
            return None
        locals_.append(torch.stack([c for c in counts if c is not None]))
    totals = torch.stack([local.sum() for local in locals_]).to(device or torch.device("cpu"))
    work = None
    if not alone and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        work = torch.distributed.all_reduce(totals, async_op=True)
    window = _Window(locals_, totals, work, 1 if alone else copies, ranks, summed=summed)
    return [StepWeights(window, i, len(local), weighted=not alone) for i, local in enumerate(locals_)]


def step_weights(
    micro_batches: Sequence[Any],
    loss: Any,
    module: Any,
    label_key: str,
    mesh: Mesh,
    device: torch.device | None = None,
) -> StepWeights | None:
    """One weight per micro-batch of an optimizer step on this rank (see the module doc), or
    None when the loss needs none. Tensor-parallel ranks hold the same items (counted once);
    sequence-parallel ranks each count their slice (`framework.backend.sequence_parallel`, whose
    `gradient_share` corrects ZeRO 0-2's gradient sum over them). Collective over all ranks:
    every rank calls it once per optimizer step, with the same number of micro-batches; the count
    is reduced on `device` (the process context's collective device; the CPU when None), started
    here and awaited when a weight is first read (`StepWeights`)."""
    found = window_weights([micro_batches], loss, module, label_key, mesh, device)
    return None if found is None else found[0]
