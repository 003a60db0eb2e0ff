"""One rollout of GRPO, scored: the completions of a step's prompts (every accumulation step's,
sampled together), their rewards, their advantages, and the step's metrics over every rank.

Each rank samples the G completions of its own prompts (`framework.methods.rollout`); the
rewards, completion lengths and whether each group's rewards agree are then gathered from every
rank, so the step's metrics (and `scale_rewards="batch"`) cover the global batch, and the count
of completion tokens (`loss_type="dapo"`'s denominator) is the global batch's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from framework.errors import ConfigError
from framework.methods.rewards import score
from framework.methods.rollout import (
    Batch,
    HFGenerate,
    _nanstd,
    advantages,
    completion_mask,
    laid_out,
    seed_of,
)

VALIDATION = 1 << 40  # validation rollouts draw from generators of their own (step + this)
SAMPLED_GROUPS = 2  # prompts whose completions a due sample holds


@dataclass
class Scored:
    """A scored rollout (see the module doc): this rank's micro-batches with their advantages,
    this rank's rewards, the global batch's completion tokens and the step's metrics."""

    batches: list[Batch]
    rewards: torch.Tensor
    tokens: float
    reward_std: torch.Tensor
    step_metrics: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)


def _tokenizer(method: Any) -> Any:
    if method.tokenizer is None:
        raise ConfigError(
            "GRPO needs the prompts' tokenizer: use data=hf_prompts (it carries it), or give GRPO(tokenizer=...)"
        )
    return method.tokenizer


def _generator(method: Any, tok: Any) -> Any:
    if method.generator is not None:
        return method.generator
    c = method.config
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    return HFGenerate(c.max_completion_length, c.temperature, c.top_k, c.top_p, tok.eos_token_id, pad)


def _rows(batch: dict[str, Any], group: int) -> dict[str, Any]:
    """A prompts batch with each row repeated `group` times (tensors and lists alike)."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[key] = value.repeat_interleave(group, dim=0)
        else:
            out[key] = [item for item in value for _ in range(group)]
    return out


def _completions(tok: Any, prompts: list[Any], ids: torch.Tensor, mask: torch.Tensor) -> list[Any]:
    """The completions as text (chat prompts: one assistant message each), as reward functions get them."""
    texts = tok.batch_decode(
        [row[: int(n)].tolist() for row, n in zip(ids, mask.sum(-1))], skip_special_tokens=True
    )
    return [
        t if isinstance(p, str) else [{"role": "assistant", "content": t}] for p, t in zip(prompts, texts)
    ]


def score_rollout(
    method: Any, engine: Any, prompt_batches: list[dict[str, Any]], step: int, validation: bool = False
) -> Scored:
    """Sample, score and weigh the completions of `prompt_batches` (this rank's micro-batches)."""
    tok, g, c = _tokenizer(method), method.config.num_generations, method.config
    rows = [_rows(b, g) for b in prompt_batches]
    offset = VALIDATION if validation else 0
    requests = []
    for row in rows:
        index = row["index"].tolist()
        seeds = [seed_of(engine.seed, step + offset, int(p) * g + k % g) for k, p in enumerate(index)]
        requests.append((row["prompt_ids"], row["prompt_mask"], seeds))
    generated = _generate_all(method, engine, tok, requests)
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    batches: list[Batch] = []
    local_rewards: list[torch.Tensor] = []
    lengths: list[torch.Tensor] = []
    ended_all: list[torch.Tensor] = []
    samples: list[dict[str, Any]] = []
    for row, ids in zip(rows, generated):
        mask, ended = completion_mask(ids, eos)
        prompts = list(row["prompt"])
        completions = _completions(tok, prompts, ids, mask)
        skip = {"prompt_ids", "prompt_mask", "prompt", "index"}
        columns = {k: v if isinstance(v, list) else v.tolist() for k, v in row.items() if k not in skip}
        columns["completion_ids"] = [r[: int(n)].tolist() for r, n in zip(ids, mask.sum(-1))]
        per_function = score(method.functions, prompts, completions, columns)
        local_rewards.append(per_function)
        lengths.append(mask.sum(-1))
        ended_all.append(ended)
        batches.append(laid_out(row["prompt_ids"], row["prompt_mask"], ids, mask))
        if not samples and engine.process.is_main and _sample_due(c, step, validation):
            samples = _sample(step, prompts, completions, per_function, method)
    return _weigh(method, engine, batches, local_rewards, lengths, ended_all, samples, g)


def _generate_all(method: Any, engine: Any, tok: Any, requests: list[Any]) -> list[torch.Tensor]:
    """Every micro-batch's completions, the weights gathered once for all of them."""
    generator = _generator(method, tok)
    generate_all = getattr(generator, "generate_all", None)
    if callable(generate_all):
        return generate_all(engine, requests)
    return [generator.generate(engine, *request) for request in requests]


def _sample_due(config: Any, step: int, validation: bool) -> bool:
    every = int(config.log_completions_every)
    return not validation and every > 0 and (step + 1) % every == 0


def _sample(
    step: int, prompts: list[Any], completions: list[Any], per_function: torch.Tensor, method: Any
) -> list[dict[str, Any]]:
    """The first prompts' completions and rewards, for the completions file."""
    count = min(len(prompts), SAMPLED_GROUPS * method.config.num_generations)
    out = []
    for i in range(count):
        record: dict[str, Any] = {"step": step + 1, "prompt": prompts[i], "completion": completions[i]}
        for f, value in zip(method.functions, per_function[i].tolist()):
            record[f"rewards/{f.name}"] = None if value != value else value
        out.append(record)
    return out


def _aggregate(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted sum of the functions' rewards per completion; NaN where none scored it."""
    total = torch.nansum(per_function * weights.unsqueeze(0), dim=1)
    return total.masked_fill(torch.isnan(per_function).all(dim=1), float("nan"))


def _weigh(
    method: Any,
    engine: Any,
    batches: list[Batch],
    local: list[torch.Tensor],
    lengths: list[torch.Tensor],
    ended: list[torch.Tensor],
    samples: list[dict[str, Any]],
    group: int,
) -> Scored:
    """Advantages per micro-batch, and the step's metrics over every rank's completions."""
    per_function = torch.cat(local)
    gathered = engine.process.all_gather_object(
        (per_function, torch.cat(lengths).cpu(), torch.cat(ended).cpu())
    )
    everyone = torch.cat([part[0] for part in gathered])
    all_lengths = torch.cat([part[1] for part in gathered]).double()
    everyone_rewards = _aggregate(everyone, method.weights)
    agree = []
    for batch, rewards in zip(batches, local):
        batch.advantages, same = advantages(
            _aggregate(rewards, method.weights), group, str(method.config.scale_rewards), everyone_rewards
        )
        agree.append(same)
    std = _nanstd(everyone_rewards.reshape(1, -1))[0]
    agreeing = engine.process.all_gather_object(torch.cat(agree).cpu())
    metrics: dict[str, tuple[Any, Any]] = {
        "reward": (torch.nanmean(everyone_rewards), 1),
        "reward_std": (std, 1),
        "frac_reward_zero_std": (torch.cat(agreeing).double().mean(), 1),
        "completions/mean_length": (all_lengths.mean(), 1),
        "completions/min_length": (all_lengths.min(), 1),
        "completions/max_length": (all_lengths.max(), 1),
        "completions/clipped_ratio": ((~torch.cat([part[2] for part in gathered])).double().mean(), 1),
    }
    for i, function in enumerate(method.functions):
        metrics[f"rewards/{function.name}/mean"] = (torch.nanmean(everyone[:, i]), 1)
        metrics[f"rewards/{function.name}/std"] = (_nanstd(everyone[:, i].reshape(1, -1))[0], 1)
    mine = _aggregate(per_function, method.weights)
    return Scored(batches, mine, float(all_lengths.sum()), std, metrics, samples)
