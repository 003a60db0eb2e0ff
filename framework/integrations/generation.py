"""Sampling completions from a transformers model, each from a random generator of its own.

`sample(model, ids, mask, generators, ...)` runs `model.generate` with its key/value cache, in
greedy mode, behind a logits processor that makes greedy decoding a draw from the sampling
distribution: the logits are divided by the temperature, cut to the `top_k` most likely tokens
and to the smallest set whose probability reaches `top_p`, and then each row adds Gumbel noise
drawn from its own `torch.Generator` (the Gumbel-max trick: the argmax of log p + Gumbel noise
is a draw from p). A completion's tokens therefore depend on its prompt, the weights and its own
generator only: never on which other rows share its batch, how many ranks there are, or the
global random state (which this leaves untouched).

Position ids follow the attention mask (`cumsum - 1`), so a left-padded prompt is read as the
same prompt however much padding its batch needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def _processor(temperature: float, top_k: int, top_p: float, generators: Sequence[torch.Generator]) -> Any:
    from transformers import LogitsProcessor

    class GumbelSampling(LogitsProcessor):
        """Temperature, top-k and top-p, then one row's Gumbel noise from its own generator."""

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            logits = scores.float() / temperature
            if 0 < top_k < logits.shape[-1]:
                kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
                logits = logits.masked_fill(logits < kth, -math.inf)
            if top_p < 1.0:
                ordered, order = torch.sort(logits, descending=True, dim=-1)
                before = torch.softmax(ordered, dim=-1).cumsum(-1) - torch.softmax(ordered, dim=-1)
                cut = (before >= top_p).scatter(-1, order, before >= top_p)
                logits = logits.masked_fill(cut, -math.inf)
            noise = torch.stack(
                [torch.rand(logits.shape[-1], generator=g, dtype=torch.float64) for g in generators]
            )
            gumbel = -torch.log(-torch.log(noise.clamp_min(1e-300))).to(logits.device, logits.dtype)
            return logits + gumbel

    return GumbelSampling()


def sample(
    model: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    generators: Sequence[torch.Generator],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: Any = None,
    pad_token_id: int = 0,
) -> torch.Tensor:
    """The sampled completions of the left-padded prompts `ids` (`mask` their attention), one row
    per generator, as a tensor of at most `max_new_tokens` tokens per row (right-padded with
    `pad_token_id` after the row's end of sequence)."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        num_beams=1,
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=config,
            logits_processor=[_processor(temperature, top_k, top_p, generators)],
        )
    return out[:, ids.shape[1] :]
