"""Whole weights in and out of a model whose parameters may be ZeRO-3 partitions or pipeline stages.

Gathering is done one module at a time (a module's own parameters only), so no rank ever holds
more than one module's weights on the device at once, and the consolidated copy is kept on rank 0
only unless every rank asks for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from framework import device as dev
from framework import pipeline as pipeline_lib
from framework import watchdog


def consolidate(
    module: nn.Module,
    zero3: bool,
    pipe: nn.Module | None = None,
    on_every_rank: bool = False,
    master: bool = False,
    masters: dict[int, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """`module`'s state dict as CPU tensors, on rank 0 ({} elsewhere unless `on_every_rank`).
    Collective. `pipe`: the pipeline module whose stages hold the weights. `master`: take each
    parameter from the optimizer's fp32 master copy where DeepSpeed keeps one (mixed precision,
    ZeRO >= 1), so an export under bf16 is not rounded to bf16; `masters` ({id(param): fp32
    tensor}) gives them where DeepSpeed offers no accessor (ZeRO-0 under mixed precision)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    keep = on_every_rank or dev.is_main_process()
    if pipe is not None:
        parts = dev.all_gather_object(pipeline_lib.local_state_dict(pipe, module, master))
        return {k: v for part in parts for k, v in part.items()} if keep else {}
    entries = module.state_dict(keep_vars=True)  # parameter objects, not copies
    keys_of: dict[int, list[str]] = {}
    for key, value in entries.items():
        keys_of.setdefault(id(value), []).append(key)
    out: dict[str, torch.Tensor] = {}
    for sub in module.modules():
        own = [p for p in sub.parameters(recurse=False) if id(p) in keys_of]
        fp32 = [safe_get_full_fp32_param(p) if master else None for p in own]  # collective under ZeRO-3
        fp32 = [m if m is not None else (masters or {}).get(id(p)) for p, m in zip(own, fp32)]
        gather = [p for p, m in zip(own, fp32) if m is None]
        with deepspeed.zero.GatheredParameters(gather, modifier_rank=None, enabled=zero3 and bool(gather)):
            for p, m in zip(own, fp32):
                keys = keys_of.pop(id(p))
                if keep:
                    value = (m if m is not None else p).detach()
                    out.update({key: value.cpu().clone() for key in keys})
    if not keep:
        return {}
    for remaining in keys_of.values():  # buffers (never partitioned)
        for key in remaining:
            out[key] = entries[key].detach().cpu().clone()
    return {key: out[key] for key in entries}


def fp32_masters(optimizer: Any) -> dict[int, torch.Tensor]:
    """{id(param): its fp32 master} from DeepSpeed's mixed-precision optimizer at ZeRO-0 (its
    `fp16_groups` / `fp32_groups`, kept side by side; empty for other optimizers)."""
    low, high = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if not low or not high:
        return {}
    return {id(p): m for lows, highs in zip(low, high) for p, m in zip(lows, highs) if p.shape == m.shape}


def load_whole(module: nn.Module, zero3: bool, state: dict[str, Any]) -> None:
    """Load complete weights into `module`. Under ZeRO-3 one module's parameters are gathered at
    a time (never the whole model on a rank) and rank 0's values are the ones used; buffers are
    loaded on every rank. Keys and shapes must match exactly, as `load_state_dict(strict=True)`."""
    import deepspeed

    if not zero3:
        module.load_state_dict(state, strict=True)
        return
    entries = module.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(entries) - set(state)), sorted(set(state) - set(entries))
    if missing or unexpected:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing[:5]}, "
            f"unexpected keys {unexpected[:5]}"
        )
    key_of: dict[int, str] = {}
    for key, value in entries.items():
        key_of.setdefault(id(value), key)  # a tied parameter: loaded once, from its first key
    with torch.no_grad():
        for sub in module.modules():
            own = [p for p in sub.parameters(recurse=False) if id(p) in key_of]
            with deepspeed.zero.GatheredParameters(own, modifier_rank=0, enabled=bool(own)):
                for p in own:
                    key = key_of.pop(id(p))
                    if dev.rank() == 0:
                        _copy_checked(p, state[key], key)
        for key in key_of.values():  # buffers (never partitioned)
            _copy_checked(entries[key], state[key], key)


def _copy_checked(target: torch.Tensor, value: torch.Tensor, key: str) -> None:
    if tuple(value.shape) != tuple(target.shape):
        raise RuntimeError(
            f"size mismatch for {key}: the weights have shape {tuple(value.shape)}, the model {tuple(target.shape)}"
        )
    target.copy_(value)


def is_hf_model(module: Any) -> bool:
    """A Hugging Face model: it has a config and can write a `save_pretrained` directory."""
    return hasattr(getattr(module, "config", None), "save_pretrained") and hasattr(module, "save_pretrained")


def save_weights(state: dict[str, torch.Tensor], out: str | Path) -> Path:
    """Write weights: safetensors for a `.safetensors` path, else a torch state dict."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Tied weights share storage; each file entry gets its own contiguous copy.
    plain = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}
    if out.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(plain, str(out))
    else:
        torch.save(plain, out)
    return out


def save_consolidated(runtime: Any, path: str | Path) -> Path:
    """The runtime's complete weights in fp32, written by rank 0 (`save_weights`); for a Hugging
    Face model and a path without a file suffix, a `save_pretrained` directory. Collective: every
    rank returns once the file is written. A large model may take longer than trainer.timeout_s, so
    the watchdog is off meanwhile and the other ranks wait on the slow gloo group (an nccl
    collective would time out instead)."""
    with watchdog.suspended():
        state = runtime.full_state_dict()
        weights = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        if dev.is_main_process():
            module = runtime.module
            if not Path(path).suffix and is_hf_model(module):
                module.config.architectures = [type(module).__name__]
                module.save_pretrained(str(path), state_dict=weights, safe_serialization=True)
            else:
                save_weights(weights, path)
        dev.barrier(slow=True)
    return Path(path)


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Read what `save_weights` wrote (no code is executed from the file)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, weights_only=True, map_location="cpu")
