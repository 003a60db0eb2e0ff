"""The rollout of an online method: completions sampled from the policy, scored, turned into
advantages, and laid out for the update.

* **Generation** sits behind one small interface, `Generator.generate(engine, ids, mask, seeds)`;
  `HFGenerate` is the one built in: the trained model whole on every rank for the whole rollout
  (`Runtime.generating`: under ZeRO-3 gathered once, not per new token; with adapters, the
  adapters generate) and transformers' `generate` with its key/value cache
  (`framework.integrations.generation`). A server or a colocated inference engine is another
  `Generator`.
* **Exact sampling**: completion k of prompt p (its row index in the data) draws from a generator
  seeded by (seed, optimizer step, p x G + k), so its tokens do not depend on the ranks, the
  accumulation, the ZeRO stage or a resume.
* **Advantages** are computed over each prompt's G completions, which one rank samples together;
  `scale_rewards="batch"` divides by the standard deviation of the whole global batch (gathered
  from every rank).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from framework.data.labels import IGNORE_INDEX
from framework.integrations import generation
from framework.methods import chunked


def seed_of(seed: int, step: int, index: int) -> int:
    """A 63-bit seed for the completion with global `index` at optimizer `step` of a run seeded `seed`."""
    digest = hashlib.blake2b(f"{seed}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Generator(Protocol):
    """What samples completions: `generate` returns `[rows, <= max_new_tokens]` token ids,
    right-padded after each row's end, one row per seed."""

    def generate(
        self, engine: Any, ids: torch.Tensor, mask: torch.Tensor, seeds: list[int]
    ) -> torch.Tensor: ...


@dataclass
class HFGenerate:
    """Sampling with transformers' `generate` on the trained model (see the module doc)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_token_id: Any = None
    pad_token_id: int = 0

    def generate(self, engine: Any, ids: torch.Tensor, mask: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        """One batch of prompts' completions."""
        return self.generate_all(engine, [(ids, mask, seeds)])[0]

    def generate_all(
        self, engine: Any, requests: list[tuple[torch.Tensor, torch.Tensor, list[int]]]
    ) -> list[torch.Tensor]:
        """Several batches' completions, the trained model's weights gathered once for all."""
        with engine.runtime.generating() as model:
            return [self._sample(model, ids, mask, seeds) for ids, mask, seeds in requests]

    def _sample(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        return generation.sample(
            model,
            ids,
            mask,
            generators,
            self.max_new_tokens,
            self.temperature,
            self.top_k,
            self.top_p,
            self.eos_token_id,
            self.pad_token_id,
        )


def completion_mask(completions: torch.Tensor, eos_ids: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of each completion's tokens through its first end-of-sequence token, whether it
    ended: False for a completion cut at the length limit)."""
    is_eos = torch.zeros_like(completions, dtype=torch.bool)
    for eos in eos_ids:
        is_eos |= completions == eos
    ended = is_eos.any(-1)
    width = completions.shape[1]
    first = torch.where(ended, is_eos.int().argmax(-1), torch.full_like(ended, width, dtype=torch.long))
    positions = torch.arange(width, device=completions.device)
    return (positions[None, :] <= first[:, None]).long(), ended


@dataclass
class Batch:
    """One micro-batch of the rollout, laid out for the update: prompt (left-padded) then
    completion (right-padded) per row, position ids that follow the mask, and what the loss
    needs of each completion."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    prompt_length: int
    completion_mask: torch.Tensor  # [rows, completion length]: the tokens that count
    advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    old_logps: torch.Tensor | None = None  # the sampling policy's (num_iterations > 1)
    ref_logps: torch.Tensor | None = None  # the reference's (beta > 0)

    @property
    def labels(self) -> torch.Tensor:
        """The completion's tokens as labels (-100 elsewhere), for `token_logps`."""
        labels = self.input_ids.clone()
        labels[:, : self.prompt_length] = IGNORE_INDEX
        labels[:, self.prompt_length :] = labels[:, self.prompt_length :].masked_fill(
            self.completion_mask == 0, IGNORE_INDEX
        )
        return labels


def laid_out(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completions: torch.Tensor, mask: torch.Tensor
) -> Batch:
    """Prompts and their completions as one `Batch` (see `Batch`)."""
    attention = torch.cat([prompt_mask, mask], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp_min(0)
    return Batch(torch.cat([prompt_ids, completions], 1), attention, positions, prompt_ids.shape[1], mask)


def token_logps(
    model: Any, batch: Batch, entropy: bool = False, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per completion token, log p(token) under `model` (float32), and its distribution's entropy;
    with `chunk_size`, through the model's head in chunks of that many positions, its logits never
    held (`framework.methods.chunked`: zero where the completion has ended, which the loss masks)."""
    inputs = {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "use_cache": False,
    }
    scored = (
        None if chunk_size is None else chunked.fused_scores(model, inputs, batch.labels, chunk_size, entropy)
    )
    if scored is not None:
        tail = slice(batch.prompt_length - 1, None)
        return scored.logps[:, tail], None if scored.entropy is None else scored.entropy[:, tail]
    outputs = model(**inputs)
    logits = getattr(outputs, "logits", outputs)[:, batch.prompt_length - 1 : -1].float()
    targets = batch.input_ids[:, batch.prompt_length :]
    log_p = torch.log_softmax(logits, dim=-1)
    picked = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    spread = -(log_p.exp() * log_p).sum(-1) if entropy else None
    return picked, spread


def advantages(
    rewards: torch.Tensor, group: int, scale: str, everyone: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantage, whether its group's rewards all agree) per completion: the reward minus its
    group's mean, divided by the group's standard deviation (`scale="group"`), by the global
    batch's (`"batch"`, from `everyone`: every rank's rewards) or by nothing (`"none"`); NaN rewards
    (no function scored the completion) are left out and get 0."""
    grouped = rewards.view(-1, group)
    mean = _nanmean(grouped).repeat_interleave(group)
    std = _nanstd(grouped).repeat_interleave(group) if group > 1 else torch.zeros_like(rewards)
    flat = std
    if scale == "batch":
        pool = everyone if everyone is not None else rewards
        flat = _nanstd(pool.reshape(1, -1)).expand_as(rewards)
    out = rewards - mean
    if scale != "none":
        out = out / (flat + 1e-4)
    return torch.nan_to_num(out, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def _nanmean(x: torch.Tensor) -> torch.Tensor:
    return torch.nanmean(x, dim=-1)


def _nanstd(x: torch.Tensor) -> torch.Tensor:
    """Unbiased standard deviation over the last dimension, NaNs left out (TRL's nanstd)."""
    count = (~torch.isnan(x)).sum(-1)
    mean = torch.nanmean(x, dim=-1, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=-1) * count / (count - 1).clamp_min(1)
    return var.sqrt()
