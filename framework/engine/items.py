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
training micro-batch holds the same number of samples, so they need no weight. The counts are
device tensors all-reduced without a host sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from framework.backend import sequence_parallel
from framework.data.outputs import is_model_loss, split
from framework.integrations.hf import predicts_next_token
from framework.plan.run_plan import Mesh

IGNORE_INDEX = -100


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


def step_weights(
    micro_batches: Sequence[Any],
    loss: Any,
    module: Any,
    label_key: str,
    mesh: Mesh,
    zero_stage: int = 0,
    device: torch.device | None = None,
) -> list[torch.Tensor] | None:
    """One weight per micro-batch of an optimizer step on this rank (see the module doc), or
    None when the loss needs none. Tensor-parallel ranks hold the same items (counted once);
    sequence-parallel ranks each count their slice (`framework.backend.sequence_parallel`, whose
    `gradient_share` corrects ZeRO 0-2's gradient sum over them). Collective over all ranks:
    every rank calls it once per optimizer step, with the same number of micro-batches; the count
    is reduced on `device` (the process context's collective device; the CPU when None)."""
    ranks, copies = mesh.dp_size * mesh.sp_size, mesh.tp_size  # whose losses add up; who holds an item
    if mesh.sp_size > 1:
        micro_batches = [sequence_parallel.shard(batch, mesh, label_key) for batch in micro_batches]
    counts = [_items_of(batch, loss, module, label_key) for batch in micro_batches]
    if not counts or any(c is None for c in counts):
        return None
    local = torch.stack([c for c in counts if c is not None])
    total = local.sum().to(device or torch.device("cpu"))
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(total)
    total = (total.to(local.device) / copies).clamp_min(1.0)
    scale = ranks * len(micro_batches) / total
    weights = local * scale if reduction_of(loss) == "mean" else scale.expand(len(micro_batches))
    return [w.to(torch.float32) for w in weights.unbind()]
