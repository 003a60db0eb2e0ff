"""Metrics per mode: training and evaluation keep separate state (as Lightning does per stage).

`Metrics` holds the user's torchmetrics objects for training and a copy of each for evaluation,
so evaluating in the middle of an epoch never mixes its samples into the training numbers.
State goes in and out through torchmetrics' public API (`metric_state`, `load_state_dict`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from framework.data.labels import IGNORE_INDEX


class Accuracy(torch.nn.Module):
    """Top-1 accuracy over everything seen since the last `reset()`, summed over ranks at
    `compute()` (one all-reduce). The same numbers as torchmetrics' `MulticlassAccuracy(average=
    "micro")`, without importing torchmetrics (about half a second of every start); its state
    goes in and out the same way (`metric_state`, `load_state_dict`)."""

    validate_args = False
    ignore_index = IGNORE_INDEX  # skipped here, on the device (`MetricSet.update` need not drop them)
    correct: torch.Tensor
    total: torch.Tensor

    def __init__(self, num_classes: int | None = None):
        super().__init__()
        self.num_classes = num_classes
        self.register_buffer("correct", torch.zeros((), dtype=torch.long))
        self.register_buffer("total", torch.zeros((), dtype=torch.long))

    @property
    def metric_state(self) -> dict[str, torch.Tensor]:
        """The accumulated counts."""
        return {"correct": self.correct, "total": self.total}

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Count the samples whose highest logit is their label, those labelled `IGNORE_INDEX`
        left out (no host sync)."""
        predicted = logits.argmax(dim=-1) if logits.dim() > labels.dim() else logits
        counted = labels != IGNORE_INDEX
        self.correct += ((predicted == labels) & counted).sum()
        self.total += counted.sum()

    def compute(self) -> torch.Tensor:
        """Correct / total over every rank (summed where the group's backend wants it: on this
        rank's GPU under nccl, on the CPU under gloo)."""
        import torch.distributed as dist

        counts = torch.stack([self.correct, self.total])
        if dist.is_initialized() and dist.get_world_size() > 1:
            counts = counts if dist.get_backend() == "nccl" else counts.cpu()
            dist.all_reduce(counts)
        return counts[0].float() / counts[1].clamp(min=1).float()

    def reset(self) -> None:
        """Forget what was seen."""
        self.correct.zero_()
        self.total.zero_()

    def merge_state(self, incoming: dict[str, torch.Tensor]) -> None:
        """Add another rank's counts (torchmetrics' `merge_state`)."""
        self.correct += incoming["correct"].to(self.correct.device)
        self.total += incoming["total"].to(self.total.device)


def metric_name(metric: Any) -> str:
    """`MulticlassAccuracy` -> "accuracy"."""
    name = type(metric).__name__
    for prefix in ("Multiclass", "Multilabel", "Binary"):
        if name.startswith(prefix) and len(name) > len(prefix):
            name = name[len(prefix) :]
    return name.lower()


def named_metrics(metrics: Any) -> dict[str, Any]:
    """A {name: metric} dict from a metric, a list of them or a dict."""
    if metrics is None:
        return {}
    if isinstance(metrics, dict) or hasattr(metrics, "items"):
        return dict(metrics.items())
    if not isinstance(metrics, (list, tuple)):
        metrics = [metrics]
    return {metric_name(m): m for m in metrics}


class MetricSet:
    """Named metrics that accumulate together until `reset()`."""

    def __init__(self, metrics: dict[str, Any]):
        self.metrics = metrics
        self.updates = 0  # batches accumulated since the last reset

    def __getitem__(self, name: str) -> Any:
        return self.metrics[name]

    def __iter__(self) -> Any:
        return iter(self.metrics)

    def __len__(self) -> int:
        return len(self.metrics)

    def to(self, device: torch.device) -> None:
        """Move every metric's state to `device`."""
        for metric in self.metrics.values():
            metric.to(device)

    def update(self, outputs: Any, labels: Any, shifted: bool = False) -> None:
        """Accumulate one batch: what every metric sees is decided here. `shifted`: the logits at
        position t predict labels[t + 1] (a causal LM given `labels=`, as Hugging Face's own loss
        reads them). Positions labelled `IGNORE_INDEX` never count in the framework's Accuracy;
        with `shifted` labels (where -100 is Hugging Face's padding), a metric of another kind gets
        only the counted positions unless its own `ignore_index` is -100 (on a GPU, selecting them
        waits for the device; other labels are passed as they are, no sync). Argument checks (a
        host sync on GPU) run on the first batch only."""
        if labels is None or not isinstance(outputs, torch.Tensor) or not self.metrics:
            return
        logits = outputs.detach().float()
        if shifted and isinstance(labels, torch.Tensor) and labels.dim() >= 2 and logits.dim() > labels.dim():
            logits, labels = logits[:, :-1], labels[:, 1:]
        counted: tuple[torch.Tensor, Any] | None = None
        for metric in self.metrics.values():
            if not shifted or getattr(metric, "ignore_index", None) == IGNORE_INDEX or not _integer(labels):
                metric.update(logits, labels)
            else:
                if counted is None:
                    keep = labels != IGNORE_INDEX
                    counted = (logits[keep], labels[keep])
                metric.update(*counted)
            if getattr(metric, "validate_args", False):
                metric.validate_args = False
        self.updates += 1

    def compute(self, prefix: str = "") -> dict[str, Any]:
        """The accumulated values (synced across ranks by torchmetrics), as floats; {} before any update."""
        if self.updates == 0:
            return {}
        out = {}
        for name, metric in self.metrics.items():
            value = metric.compute()
            out[prefix + name] = (
                float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            )
        return out

    def reset(self) -> None:
        """Clear the accumulated state."""
        for metric in self.metrics.values():
            metric.reset()
        self.updates = 0

    def state_dict(self) -> dict[str, Any]:
        """Each metric's state as CPU tensors (loadable on any device), and the update count."""
        states = {
            name: {k: _to_cpu(v) for k, v in metric.metric_state.items()}
            for name, metric in self.metrics.items()
        }
        return {"metrics": states, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Put back what `state_dict` returned, on `device`."""
        for name, metric in self.metrics.items():
            if name in state["metrics"]:
                metric.load_state_dict(dict(state["metrics"][name]), strict=False)
                if device is not None:
                    metric.to(device)
        self.updates = int(state["updates"])

    def load_merged(self, states: list[dict[str, Any]], device: torch.device, take: bool) -> None:
        """For a run on another number of ranks: what every saving rank's `state_dict` held, merged
        into this rank when `take` (one rank of the new run takes it all, each metric's own
        `merge_state`; the others start empty), so the value synced over the new ranks is the one
        the saving run would have computed. The update count (counted alike on every rank) is kept."""
        self.reset()
        self.to(device)
        for name, metric in self.metrics.items():
            parts = [state["metrics"][name] for state in states if name in state["metrics"]]
            for part in parts if take else []:
                metric.merge_state({k: _to_device(v, device) for k, v in part.items()})
        self.updates = int(states[0]["updates"])


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    return value


def _integer(labels: Any) -> bool:
    return isinstance(labels, torch.Tensor) and not labels.is_floating_point() and labels.dtype != torch.bool


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


class Metrics:
    """The training and the evaluation `MetricSet` of one engine."""

    def __init__(self, metrics: Any = None):
        named = named_metrics(metrics)
        self.train = MetricSet(named)
        self.eval = MetricSet({name: copy.deepcopy(metric) for name, metric in named.items()})

    def __bool__(self) -> bool:
        return bool(len(self.train))

    def for_mode(self, mode: str) -> MetricSet:
        """The set `mode` accumulates into (predict uses none: the eval set, unused)."""
        return self.train if mode == "train" else self.eval

    def to(self, device: torch.device) -> None:
        """Move both sets to `device`."""
        self.train.to(device)
        self.eval.to(device)

    def reset(self) -> None:
        """Clear both sets."""
        self.train.reset()
        self.eval.reset()
