"""Preference tuning: the DPO objective (Rafailov et al. 2023; IPO, Azar et al. 2023) as a
training step over batches of pairs (`framework.data.datasets.preference`).

    dpo = DPO(beta=0.1, reference=copy.deepcopy(model))      # or a peft model: no reference
    engine = Engine(model, optimizer=..., train_step=dpo, eval_step=dpo.eval_step)
    engine.fit(pairs, batch_size=8, collate_fn=pairs.collate_fn)

Chosen and rejected answers go through the model in one forward pass (concatenated on the batch
dimension, padded to one length); a sequence's log-probability is the sum over its answer tokens
(labels != -100) of log p(token | what precedes it). With s = beta x ((policy - reference) of
the chosen - (policy - reference) of the rejected), the loss of a pair is

    sigmoid (DPO):  -(1 - label_smoothing) log sigmoid(s) - label_smoothing log sigmoid(-s)
    ipo:            (s / beta - 1 / (2 beta))^2      (log-probabilities averaged over answer tokens)

as TRL's `DPOTrainer` computes it. A micro-batch's loss is the mean over its pairs; every
training micro-batch holds the same number of pairs, so DeepSpeed's average over accumulation
steps and data-parallel ranks makes the update that of the global batch's mean over its pairs,
whatever the layout (no item weighting, `framework.engine.items`, is needed).

The reference log-probabilities come from, in this order: the batch (`reference_chosen_logps`
and `reference_rejected_logps`, stored once before training by `with_reference_logps`, i.e.
`objective.precompute_reference=true`); the policy itself with its adapters disabled (a `peft`
model: no second copy); a frozen `reference` module (a copy made before DeepSpeed, under ZeRO-3
handed to its own DeepSpeed engine at the first step, so partitioned like the policy).

Each logged step gets TRL's reward metrics over the pairs since the last logging point, summed
over ranks (`step_logs`): rewards/chosen, rewards/rejected (beta x (policy - reference)),
rewards/margins and rewards/accuracy (the share of pairs whose chosen reward is higher). A
checkpoint keeps those sums (`step_state`), so a resumed run logs what the uninterrupted one
logs; validation reports the same four over its pairs (`eval_logs`: val_rewards/...).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from framework.data.labels import IGNORE_INDEX
from framework.data.outputs import logits_of, takes_use_cache
from framework.errors import ConfigError
from framework.integrations.preference import adapters_disabled, has_adapters

LOSS_TYPES = ("sigmoid", "ipo")
REFERENCE_KEYS = ("reference_chosen_logps", "reference_rejected_logps")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per row: the sum (or, `average`, the mean) over the answer tokens of log p(label), position
    t's logits scoring label t + 1 (a causal LM); float32 whatever the logits' dtype."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    counted = labels != IGNORE_INDEX
    # log p = logit - logsumexp(logits): no second vocabulary-sized tensor as log_softmax would make
    picked = torch.gather(logits, 2, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    total = (picked * counted).sum(-1)
    return total / counted.sum(-1).clamp_min(1) if average else total


def dpo_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses, chosen rewards, rejected rewards) per pair, from sequence log-probabilities."""
    logits = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)
    if loss_type == "sigmoid":
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ConfigError(f"objective.loss_type={loss_type}: one of {', '.join(LOSS_TYPES)}")
    chosen = beta * (policy_chosen - reference_chosen).detach()
    rejected = beta * (policy_rejected - reference_rejected).detach()
    return losses, chosen, rejected


def concatenated(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) of the chosen rows, then the rejected ones (the
    collate pads both to one length)."""
    try:
        ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
        mask = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
        labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    except (KeyError, TypeError) as exc:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise ConfigError(
            f"DPO needs batches of pairs (chosen_/rejected_ input_ids, attention_mask, labels), got {keys}: "
            "use data=hf_preference"
        ) from exc
    return ids, mask, labels


def pair_logps(
    model: Any, batch: dict[str, Any], average: bool, output_key: str | None = None, no_cache: bool = True
) -> tuple[Any, Any]:
    """(chosen, rejected) sequence log-probabilities of `model` from one forward pass (`no_cache`:
    a Hugging Face model is asked for no key/value cache)."""
    ids, mask, labels = concatenated(batch)
    outputs = model(input_ids=ids, attention_mask=mask, **({"use_cache": False} if no_cache else {}))
    chosen, rejected = sequence_logps(logits_of(outputs, output_key), labels, average).chunk(2)
    return chosen, rejected


class RewardMeter:
    """Sums of the pairs' rewards since the last read, on the device (no host sync per step)."""

    NAMES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracy")

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None

    def add(self, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        """Count one micro-batch's pairs."""
        row = torch.stack(
            [chosen.sum(), rejected.sum(), (chosen - rejected).sum(), (chosen > rejected).float().sum()]
            + [torch.tensor(float(chosen.numel()), device=chosen.device)]
        ).double()
        self.sums = row if self.sums is None else self.sums + row

    def state_dict(self) -> dict[str, Any]:
        """The sums since the last read, on the CPU (a checkpoint between logging points)."""
        return {"sums": None if self.sums is None else self.sums.detach().cpu()}

    def load_sums(self, states: list[dict[str, Any]], device: torch.device | None = None) -> None:
        """The sum of `states` (`state_dict`s: this rank's, or on another number of ranks every
        saved rank's, given to one rank) as this meter's; reads over all ranks then see the
        saved window's totals whatever the layout."""
        saved = [s["sums"] for s in states if s.get("sums") is not None]
        self.sums = torch.stack(saved).sum(0).to(device or "cpu", torch.float64) if saved else None

    def read(self, device: torch.device | None = None) -> dict[str, float]:
        """Means over every rank's pairs since the last read (collective: every rank calls it)."""
        sums = self.sums if self.sums is not None else torch.zeros(5, dtype=torch.float64)
        sums = sums.to(device or sums.device)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(sums)
        self.sums = None
        pairs = float(sums[4].item())
        if not pairs:
            return {}
        return {name: float(value) / pairs for name, value in zip(self.NAMES, sums[:4].tolist())}


class DPO:
    """The DPO / IPO objective as a training step `step(engine, batch) -> loss` (see the module
    doc). `reference`: a frozen copy of the model made before training (not needed for a `peft`
    model or with precomputed reference log-probabilities)."""

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        precompute_reference: bool = False,
        reference: torch.nn.Module | None = None,
    ):
        if loss_type not in LOSS_TYPES:
            raise ConfigError(f"objective.loss_type={loss_type}: one of {', '.join(LOSS_TYPES)}")
        if not float(beta) > 0:
            raise ConfigError(f"objective.beta={beta}: must be > 0")
        if not 0.0 <= float(label_smoothing) < 0.5:
            raise ConfigError(f"objective.label_smoothing={label_smoothing}: must be in [0, 0.5)")
        self.beta, self.loss_type, self.label_smoothing = float(beta), loss_type, float(label_smoothing)
        self.precompute_reference = bool(precompute_reference)
        self.reference = reference
        self.meter = RewardMeter()  # training pairs since the last logging point
        self.eval_meter = RewardMeter()  # validation pairs of the evaluation under way
        self._placed = False
        if reference is not None:
            reference.eval().requires_grad_(False)

    def __call__(self, engine: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The mean loss over the micro-batch's pairs; its rewards join the meter."""
        losses, chosen, rejected = self.losses(engine, batch)
        self.meter.add(chosen, rejected)
        return losses.mean()

    def eval_step(self, engine: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The mean validation loss over the batch's pairs; their rewards join the validation meter."""
        losses, chosen, rejected = self.losses(engine, batch)
        self.eval_meter.add(chosen, rejected)
        return losses.mean()

    def losses(self, engine: Any, batch: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """(losses, chosen rewards, rejected rewards) of the batch's pairs."""
        average = self.loss_type == "ipo"
        chosen, rejected = pair_logps(
            engine.model, batch, average, engine.output_key, takes_use_cache(engine.module)
        )
        ref_chosen, ref_rejected = self.reference_logps(engine, batch, average)
        return dpo_losses(
            chosen, rejected, ref_chosen, ref_rejected, self.beta, self.loss_type, self.label_smoothing
        )

    @torch.no_grad()
    def reference_logps(self, engine: Any, batch: dict[str, Any], average: bool) -> tuple[Any, Any]:
        """The reference's (chosen, rejected) log-probabilities (see the module doc)."""
        if all(key in batch for key in REFERENCE_KEYS):
            return tuple(batch[key].float() for key in REFERENCE_KEYS)  # type: ignore[return-value]
        if has_adapters(engine.module):
            with adapters_disabled(engine.module):
                return pair_logps(
                    engine.model, batch, average, engine.output_key, takes_use_cache(engine.module)
                )
        if self.reference is None:
            raise ConfigError(
                "DPO has no reference model: set objective.precompute_reference=true, train adapters "
                "(+adapter=lora), or give DPO(reference=copy.deepcopy(model))"
            )
        if not self._placed:  # partitioned like the policy under ZeRO-3
            self.reference = engine.runtime.frozen(self.reference)
            self._placed = True
        return pair_logps(self.reference, batch, average, engine.output_key, takes_use_cache(self.reference))

    def follow(self, runtime: Any) -> None:
        """Make the frozen reference the trained model as it is now (weights loaded after the
        copy was made: `trainer.init_from`), gathered whole from `runtime` (collective: every
        rank calls it); a reference of another kind needs nothing."""
        if self.reference is not None and not self._placed:
            self.reference.load_state_dict(runtime.full_state_dict(on_every_rank=True))

    def step_logs(self, device: torch.device | None = None) -> dict[str, float]:
        """The reward metrics since the last logging point (collective; the loop calls it)."""
        return self.meter.read(device)

    def eval_logs(self, device: torch.device | None = None) -> dict[str, float]:
        """The reward metrics of the validation pairs since the last call (collective; evaluation
        calls it at its end: logged as val_rewards/...)."""
        return self.eval_meter.read(device)

    def step_state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the rewards of the steps since the last logging point."""
        return {"rewards": self.meter.state_dict()}

    def load_step_state(self, states: list[dict[str, Any]], device: torch.device | None = None) -> None:
        """Put back `step_state`s (this rank's; on another number of ranks every saved rank's on
        one rank, none on the others)."""
        self.meter.load_sums([s["rewards"] for s in states], device)


@torch.no_grad()
def with_reference_logps(engine: Any, dataset: Any, batch_size: int, collate_fn: Any) -> Any:
    """`dataset` with each pair's reference log-probabilities, computed now by the model as it is
    (before training: the reference), `batch_size` pairs per forward pass. The batches are shared
    out over the data-parallel ranks and the results gathered; every rank makes the same number
    of forward passes (under ZeRO-3 they are collective), one that has run out repeating its last."""
    if not hasattr(dataset, "__len__"):
        raise ConfigError(
            "objective.precompute_reference=true stores log-probabilities with map-style data, not a stream: "
            "set data.dataset.streaming=false, or keep a frozen reference (precompute_reference=false)"
        )
    objective = engine.train_step_fn
    average = getattr(objective, "loss_type", "sigmoid") == "ipo"
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
            c, r = pair_logps(engine.model, batch, average, engine.output_key, takes_use_cache(engine.module))
            done[start] = (c.cpu(), r.cpu())
    finally:
        runtime.train(was_training)
    for part in runtime.process.all_gather_object(done if mine else {}):
        done.update(part)
    if not starts:
        return WithReference(dataset, torch.zeros(0), torch.zeros(0))
    chosen, rejected = zip(*(done[start] for start in starts))
    return WithReference(dataset, torch.cat(chosen), torch.cat(rejected))


class WithReference(torch.utils.data.Dataset):
    """A dataset of pairs whose rows also hold their reference log-probabilities."""

    def __init__(self, dataset: Any, chosen: torch.Tensor, rejected: torch.Tensor):
        self.dataset, self.chosen, self.rejected = dataset, chosen, rejected

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.dataset[i], REFERENCE_KEYS[0]: self.chosen[i], REFERENCE_KEYS[1]: self.rejected[i]}


def objective_for(model: torch.nn.Module, options: dict[str, Any]) -> DPO:
    """The `objective` config's DPO for `model` (not yet given to DeepSpeed): its reference is the
    model with adapters disabled (a `peft` model), the stored log-probabilities
    (`precompute_reference`), or else a frozen copy made here (under ZeRO-3 partitioned like the
    model when training starts: `Runtime.frozen`). A model ZeRO-3 built partitioned (too large
    for one rank) is not copied: refused in one line."""
    if options.get("name", "dpo") != "dpo":
        raise ConfigError(f"objective.name={options['name']}: the objective so far is dpo")
    options = {k: v for k, v in options.items() if k != "name"}
    reference = None
    if not options.get("precompute_reference") and not has_adapters(model):
        if any(hasattr(p, "ds_id") for p in model.parameters()):  # built partitioned by zero.Init
            raise ConfigError(
                "DPO cannot copy a model built partitioned (too large for one rank) into a frozen reference: "
                "set objective.precompute_reference=true, or train adapters (+adapter=lora)"
            )
        reference = copy.deepcopy(model)  # under ZeRO-3 partitioned by its own engine at the first step
    return DPO(**options, reference=reference)
