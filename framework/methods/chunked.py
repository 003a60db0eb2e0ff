"""A causal LM's tokens scored without its logits: the output head applied to the positions whose
label counts, a chunk of positions at a time, the backward pass recomputing each chunk.

A method that scores tokens (SFT, the preference methods, GRPO) needs, per counted position t,
log p(label t + 1) and at times the distribution's entropy, its mean logit and whether the label
is its first choice. Computed from the logits, that holds `[rows, positions, vocabulary]` floats
and as many for their log-softmax and each gradient: at a vocabulary of 128 k and 4 k positions,
2 GB each. Here instead:

* the model's backbone runs (`hidden_states`), as the model's forward pass would run it, through
  DeepSpeed's engine (`framework.backend.head.call_as_forward`: ZeRO-3's hooks armed);
* the positions whose next label is not -100 are selected, and the head's weight multiplies
  `chunk_size` of them at a time; each chunk's logits give its statistics in float32, then are
  dropped. The backward pass recomputes each chunk's logits and sends their gradient to the
  hidden states, the weight, its bias and an adapter's matrices: nothing of vocabulary size is
  kept between chunks. The chunks run as the head module's call (`call_as_forward` again), so
  under ZeRO-3 its hooks gather the head's weights once around all the chunks of each pass.

It is the full computation chunk by chunk (the same operations on the same numbers), so the
loss and every gradient equal the logits path's (tested to 1e-6 in float32). The head may be a
linear layer (with a bias or not), an embedding tied as the head, or a `peft` LoRA layer on
either of the first, its low-rank term added per chunk (`framework.integrations.peft.head_terms`);
dropout on the adapter's input draws the same mask as the model's own forward.

Which models: a transformers causal LM whose logits are the head of the backbone's last hidden
state (`framework.integrations.hf.causal_lm_parts`), or a model of one's own with
`hidden_states(**inputs)` and `output_head()` (`framework.models.GPT`). Any other model, head
or adapter variant (DoRA on the head, a tensor-parallel head), and a model or head whose
`forward` was replaced on the instance (accelerate's hooks, a wrapper of the user's: the
chunked path would skip it), is scored from its logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.backend import head as head_lib
from framework.data.labels import IGNORE_INDEX
from framework.integrations import hf, peft

CHUNK_SIZE = 1024  # positions whose logits one chunk holds (1024 x 128 k float32: 0.5 GB)


@dataclass
class Head:
    """What the head computes: hidden @ weight.T + bias + sum of the adapters' up(down(hidden))."""

    weight: torch.Tensor  # [vocabulary, hidden]
    bias: torch.Tensor | None = None  # [vocabulary]
    # per adapter: down maps [..., hidden] to [..., r] (scaling included), up is [vocabulary, r]
    downs: list[Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=list)
    ups: list[torch.Tensor] = field(default_factory=list)

    def params(self) -> list[torch.Tensor | None]:
        """The weights the chunks read directly (whole under ZeRO-3 while the head module runs)."""
        return [self.weight, self.bias, *self.ups]


def _logits(
    hidden: torch.Tensor,
    low: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    up: torch.Tensor | None,
) -> torch.Tensor:
    """A chunk's logits in float32 (computed in the weight's dtype, as the head computes them)."""
    z = F.linear(hidden, weight, bias)
    if low is not None and up is not None:
        z = z + F.linear(low.to(up.dtype), up).to(z.dtype)
    return z.float()


class _Chunked(torch.autograd.Function):
    """Per position, as the rows of one `[4, positions]` float32 tensor: log p(label), entropy
    (zero unless asked for), mean logit, label == argmax. One tensor, so that ZeRO-3's hooks on
    the head module see one output, as they see its logits; the last two rows carry no gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        low: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        up: torch.Tensor | None,
        labels: torch.Tensor,
        chunk: int,
        entropy: bool,
    ) -> torch.Tensor:
        out = hidden.new_zeros(4, hidden.shape[0], dtype=torch.float32)
        with torch.no_grad():
            for start in range(0, hidden.shape[0], chunk):
                s = slice(start, start + chunk)
                z = _logits(hidden[s], None if low is None else low[s], weight, bias, up)
                out[2, s], out[3, s] = z.mean(-1), (z.argmax(-1) == labels[s]).float()
                log_p = z.sub_(z.logsumexp(-1, keepdim=True))  # in place: one chunk of logits held
                out[0, s] = log_p.gather(-1, labels[s, None]).squeeze(-1)
                if entropy:
                    out[1, s] = -log_p.exp().mul_(log_p).sum(-1)
                del z, log_p  # before the next chunk's logits are made
        ctx.save_for_backward(hidden, low, weight, bias, up, labels)
        ctx.chunk, ctx.entropy = chunk, entropy
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, low, weight, bias, up, labels = ctx.saved_tensors
        wants = ctx.needs_input_grad
        d_hidden = torch.zeros_like(hidden) if wants[0] else None
        d_low = torch.zeros_like(low) if low is not None and wants[1] else None
        sums: list[Any] = [None, None, None]  # float32 sums over the chunks: weight, bias, up
        spread = ctx.entropy and bool(d_out[1].any())  # an entropy only logged has no gradient
        for start in range(0, hidden.shape[0], ctx.chunk):
            s = slice(start, start + ctx.chunk)
            low_s = None if low is None else low[s]
            z = _logits(hidden[s], low_s, weight, bias, up)
            dz = _logits_grad(z, labels[s], d_out[0, s], d_out[1, s] if spread else None).to(weight.dtype)
            if d_hidden is not None:
                d_hidden[s] = dz @ weight
            if d_low is not None:
                d_low[s] = (dz.to(up.dtype) @ up).to(d_low.dtype)
            parts = [
                dz.t() @ hidden[s] if wants[2] else None,
                dz.sum(0) if wants[3] else None,
                dz.to(up.dtype).t() @ low_s.to(up.dtype)
                if up is not None and low_s is not None and wants[4]
                else None,
            ]
            sums = [_add(total, part) for total, part in zip(sums, parts)]
            del z, dz, parts  # before the next chunk's logits are made
        grads = [None if g is None else g.to(t.dtype) for g, t in zip(sums, (weight, bias, up))]
        return (d_hidden, d_low, *grads, None, None, None)


def _add(total: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    """`total + part` in float32 (None: nothing to add)."""
    if part is None:
        return total
    return part.float() if total is None else total + part.float()


def _logits_grad(
    z: torch.Tensor, labels: torch.Tensor, d_logps: torch.Tensor, d_spread: torch.Tensor | None
) -> torch.Tensor:
    """d loss / d logits of a chunk (`z`, overwritten), from the gradients of its log p(label) and
    its entropy: (onehot(label) - p) d_logps - p (log p + H) d_spread, H = -sum p log p. Two
    chunks of logits held, `z`'s and p's (a third for a while when the entropy has a gradient)."""
    log_p = z.sub_(z.logsumexp(-1, keepdim=True))
    p = log_p.exp()
    if d_spread is None:
        dz = p.mul_(-d_logps[:, None])
    else:
        spread = -(p * log_p).sum(-1, keepdim=True)
        dz = log_p.add_(spread).mul_(-d_spread[:, None]).sub_(d_logps[:, None]).mul_(p)
    return dz.scatter_add_(-1, labels[:, None], d_logps[:, None].to(dz.dtype))


@dataclass
class Scored:
    """Per position of `[rows, positions - 1]` (position t scoring label t + 1; zero where the
    label is -100): log p(label), and when asked, entropy, mean logit, label == argmax."""

    logps: torch.Tensor
    counted: torch.Tensor  # bool: the label counts
    entropy: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    correct: torch.Tensor | None = None


def _spread(values: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """Per counted position values laid out on the `[rows, positions - 1]` grid (zeros elsewhere)."""
    return values.new_zeros(counted.shape).masked_scatter(counted, values)


def _head_pass(
    picked: torch.Tensor,
    low: torch.Tensor | None,
    targets: torch.Tensor,
    head: Head,
    chunk: int,
    entropy: bool,
) -> torch.Tensor:
    """What runs as the head module's forward: the chunks over the selected positions."""
    up = torch.cat(head.ups, -1) if head.ups else None  # small: kept whole for the backward pass
    return _Chunked.apply(picked, low, head.weight, head.bias, up, targets, max(1, int(chunk)), entropy)


def score_hidden(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head_module: nn.Module,
    head: Head,
    chunk_size: int = CHUNK_SIZE,
    entropy: bool = False,
) -> dict[str, torch.Tensor]:
    """`Scored`'s fields of hidden states `[rows, positions, hidden]` scored against `labels`
    `[rows, positions]` through `head`, the terms of `head_module`, whose call it runs as (see the
    module doc)."""
    counted = labels[:, 1:] != IGNORE_INDEX
    picked = hidden[:, :-1][counted]
    lows = [down(hidden)[:, :-1][counted] for down in head.downs]  # every position: dropout as the head's
    low = torch.cat(lows, -1) if lows else None
    run = functools.partial(_head_pass, head=head, chunk=chunk_size, entropy=entropy)
    out = head_lib.call_as_forward(head_module, run, picked, low, labels[:, 1:][counted])
    scored = {"logps": _spread(out[0], counted), "counted": counted}
    values = out.detach()
    scored.update(mean_logits=_spread(values[2], counted), correct=_spread(values[3] > 0.5, counted))
    if entropy:
        scored["entropy"] = _spread(out[1], counted)
    return scored


def head_of(module: nn.Module) -> Head | None:
    """The `Head` of an output head module: a linear layer or an embedding tied as the head, seen
    through a `peft` wrapper (its LoRA adapters as low-rank terms); None for anything else."""
    terms = peft.head_terms(module)
    if terms is None:
        return None
    base, adapters = terms
    if type(base) is nn.Linear:
        return Head(base.weight, base.bias, [d for d, _ in adapters], [u for _, u in adapters])
    if isinstance(base, nn.Embedding) and not adapters:
        return Head(base.weight)
    return None


def parts_of(module: nn.Module) -> tuple[Callable[..., torch.Tensor], nn.Module] | None:
    """(the backbone's hidden states of a batch, the output head) of a causal LM, or None."""
    own, head = getattr(module, "hidden_states", None), getattr(module, "output_head", None)
    if callable(own) and callable(head):
        return own, head()
    return hf.causal_lm_parts(module)


def _forward_replaced(module: nn.Module) -> bool:
    """True when the module's `forward` was replaced on the instance (accelerate's autocast or
    device hooks, TRL's patched head, a user's wrapper): applying the head directly would skip it."""
    return "forward" in vars(module)


def fused_scores(
    model: Any, inputs: dict[str, Any], labels: torch.Tensor, chunk_size: int, entropy: bool = False
) -> Scored | None:
    """`Scored` of a batch from `model` (a DeepSpeed engine or a module) through its chunked head,
    run as its forward pass; None when the model or its head is not one this path knows."""
    module = head_lib.inner_module(model)
    parts = None if _forward_replaced(module) else parts_of(module)
    if parts is None or _forward_replaced(parts[1]):
        return None
    hidden_states, head_module = parts
    head = head_of(head_module)
    if head is None:
        return None

    head_lib.hold_with(head_module, head.params())

    def forward(**kwargs: Any) -> dict[str, torch.Tensor]:
        return score_hidden(hidden_states(**kwargs), labels, head_module, head, chunk_size, entropy)

    return Scored(**head_lib.call_as_forward(model, forward, **inputs))
