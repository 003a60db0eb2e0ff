"""Packed rows: several documents one after another in a row, their position ids restarting at
each, and the attention kept within documents however the model is called.

A document starts wherever a position id is not the previous one + 1 (transformers' rule,
`masking_utils.find_packed_sequence_indices`). transformers 5 keeps packed documents apart only
when it is given no 2-D `attention_mask` and no key/value cache (a training forward with
`use_cache=False`): a 2-D mask, even all ones, or the cache a plain `model(**row)` makes, and the
documents see each other (transformers PR 46634). `keep_documents_apart(model)` adds a forward
pre-hook to a Hugging Face model (and its backbone) that turns such a call on packed rows into
one with a 4-D block-diagonal causal mask (boolean for sdpa, additive for eager), which
transformers uses as it is; padding a 2-D mask marks stays masked. The framework's own GPT reads
the same mask from `causal_document_mask`.
"""

from __future__ import annotations

from typing import Any

import torch

from framework.errors import ConfigError

HOOKED = "_framework_documents_apart"  # set on a model whose forward has the hook
KEPT_APART = ("eager", "sdpa")  # attention implementations the hook builds a mask for


def documents(position_ids: torch.Tensor, attention_mask: Any = None) -> torch.Tensor | None:
    """(rows, length) index of each position's document within its row, or None when no row
    holds more than one document. With a 2-D `attention_mask`, a restart next to padding is not
    a document's start: left-padded prompts and right-padded completions (position ids that
    follow the mask, as generation lays them out) are one document each."""
    start = position_ids[:, :1] - 1
    steps = torch.diff(position_ids, prepend=start, dim=-1)
    found = (steps != 1).cumsum(-1)
    restarts = found[:, -1] > 0
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape == position_ids.shape:
        real = attention_mask.to(torch.bool)
        after_real = torch.nn.functional.pad(real[:, :-1], (1, 0), value=False)
        restarts = ((steps != 1) & real & after_real).any(-1)
    return found if bool(restarts.any()) else None


def causal_document_mask(
    position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """(rows, 1, length, length) boolean, True where a query position may attend a key position:
    causal, within its document, and (with a 2-D `attention_mask`) not on padding. Every
    position sees itself, so a padding query's row is never empty (its output is not scored)."""
    length = position_ids.shape[-1]
    found = documents(position_ids)
    if found is None:
        found = torch.zeros_like(position_ids)
    allowed = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = allowed & (found[:, :, None] == found[:, None, :])
    if attention_mask is not None:
        allowed = allowed & attention_mask.to(torch.bool)[:, None, :]
    allowed = allowed | torch.eye(length, dtype=torch.bool, device=position_ids.device)
    return allowed[:, None]


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    ids = args[0] if args else kwargs.get("input_ids")
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    return int(ids.shape[0]) if isinstance(ids, torch.Tensor) else None


def _apart(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The forward pre-hook (see the module doc): None leaves the call as it is."""
    positions = kwargs.get("position_ids")
    mask = kwargs.get("attention_mask")
    if (
        not isinstance(positions, torch.Tensor)
        or positions.dim() != 2
        or kwargs.get("past_key_values") is not None
    ):
        return None
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        return None  # a 4-D mask is the caller's own
    if documents(positions, mask) is None:
        return None
    core = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if core not in KEPT_APART:
        if mask is None and kwargs.get("use_cache") is False:
            return None  # transformers keeps them apart itself
        raise ConfigError(
            f"packed rows (position ids restarting per document) on a model with attn_implementation={core}: "
            f"pass no attention_mask and use_cache=False, or use one of {', '.join(KEPT_APART)}, whose "
            "attention the framework keeps within documents"
        )
    rows = _rows(args, kwargs)
    if rows is not None and positions.shape[0] != rows:
        positions = positions.expand(rows, -1)
    allowed = causal_document_mask(positions, mask)
    if core == "eager":  # eager adds the mask to its scores
        dtype = getattr(module, "dtype", torch.float32)
        dtype = dtype if dtype.is_floating_point else torch.float32
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        allowed = zero.masked_fill(~allowed, torch.finfo(dtype).min)
    return args, {**kwargs, "attention_mask": allowed}


def keep_documents_apart(model: Any) -> Any:
    """`model` with the hook on every Hugging Face model in it (the causal LM and its backbone,
    which a loss applying the head itself calls); once per model, idempotent."""
    for sub in model.modules():
        if getattr(sub, HOOKED, False) or not hasattr(getattr(sub, "config", None), "_attn_implementation"):
            continue
        if not callable(getattr(sub, "save_pretrained", None)):
            continue
        sub.register_forward_pre_hook(_apart, with_kwargs=True)
        setattr(sub, HOOKED, True)
    return model
