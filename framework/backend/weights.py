"""Whole weights in and out of a model whose parameters may be ZeRO-3 partitions or pipeline stages.

Gathering is done one module at a time (a module's own parameters only), so no rank ever holds
more than one module's weights on the device at once, and the consolidated copy is kept on rank 0
only unless every rank asks for it.
"""

from __future__ import annotations

import contextlib
import pickle
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from framework.backend import deepspeed_globals, expert_parallel
from framework.backend import pipeline as pipeline_lib
from framework.errors import CheckpointError
from framework.integrations.hf import is_hf_model
from framework.process import watchdog
from framework.process.context import ProcessContext


def consolidate(
    module: nn.Module,
    zero3: bool,
    pipe: nn.Module | None = None,
    on_every_rank: bool = False,
    master: bool = False,
    masters: dict[int, torch.Tensor] | None = None,
    process: ProcessContext | None = None,
) -> dict[str, torch.Tensor]:
    """`module`'s state dict as CPU tensors, on rank 0 ({} elsewhere unless `on_every_rank`).
    Collective. `pipe`: the pipeline module whose stages hold the weights. `master`: take each
    parameter from the optimizer's fp32 master copy where DeepSpeed keeps one (mixed precision,
    ZeRO >= 1), so an export under bf16 is not rounded to bf16; `masters` ({id(param): fp32
    tensor}) gives them where DeepSpeed offers no accessor (ZeRO-0 under mixed precision).
    Experts split by expert parallelism come back whole, under the model's own names. `process`:
    the job's context (None: this process alone)."""
    deepspeed = deepspeed_globals.load()
    from deepspeed.utils import safe_get_full_fp32_param

    keep = on_every_rank or process is None or process.is_main
    if pipe is not None:
        local = pipeline_lib.local_state_dict(pipe, module, master)
        parts = process.all_gather_object(local) if process is not None else [local]
        return {k: v for part in parts for k, v in part.items()} if keep else {}
    entries = module.state_dict(keep_vars=True)  # parameter objects, not copies
    keys_of: dict[int, list[str]] = {}
    for key, value in entries.items():
        keys_of.setdefault(id(value), []).append(key)
    out: dict[str, torch.Tensor] = {}
    experts = expert_parallel.expert_layers(module)
    for sub in module.modules():
        own = [p for p in sub.parameters(recurse=False) if id(p) in keys_of]
        fp32 = [safe_get_full_fp32_param(p) if master else None for p in own]  # collective under ZeRO-3
        fp32 = [m if m is not None else (masters or {}).get(id(p)) for p, m in zip(own, fp32)]
        gather = [p for p, m in zip(own, fp32) if m is None]
        with deepspeed.zero.GatheredParameters(gather, modifier_rank=None, enabled=zero3 and bool(gather)):
            with _whole_tensor_parallel(sub, own, fp32) as values:
                values = expert_parallel.whole_experts(experts.get(id(sub)), values)
                for p, value in zip(own, values):
                    keys = keys_of.pop(id(p))
                    if keep:
                        out.update({key: value.detach().cpu().clone() for key in keys})
    if not keep:
        return {}
    for remaining in keys_of.values():  # buffers (never partitioned)
        for key in remaining:
            out[key] = entries[key].detach().cpu().clone()
    return expert_parallel.source_layout(module, {key: out[key] for key in entries})


@contextlib.contextmanager
def _whole_tensor_parallel(
    module: nn.Module, params: Sequence[torch.Tensor], masters: Sequence[torch.Tensor | None]
) -> Iterator[list[torch.Tensor]]:
    """The values of `module`'s own `params` (their fp32 masters where given), whole: a layer
    that tensor parallelism split (DeepSpeed's AutoTP) is gathered over its ranks for the
    duration, its masters gathered with it (swapped in, as the layer knows its own split; a
    fused q/k/v is interleaved), then split again. Collective for such a layer."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    split = [p for p in params if getattr(p, "ds_is_replaced_module", False)]
    if not split:
        yield [m if m is not None else p for p, m in zip(params, masters)]
        return
    kept = [p.data for p in params]
    for p, m in zip(params, masters):
        if m is not None:
            p.data = m.view(p.shape) if m.numel() == p.numel() else m
    try:
        with GatherReplacedLayerParams(params, module, enabled=True):
            yield [p.data for p in params]
    finally:
        for p, data in zip(params, kept):
            p.data = data


def whole_shape(param: torch.Tensor) -> list[int]:
    """The shape of `param` whole: before ZeRO-3 partitioned it (`ds_shape`) and before tensor
    parallelism split it (the logical shape DeepSpeed's AutoTP records on the parameter)."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    logical = (getattr(param, DS_AUTOTP_UC_META, None) or {}).get("logical_shape")
    shape = logical if logical is not None else getattr(param, "ds_shape", param.shape)
    return [int(n) for n in shape]


def fp32_masters(optimizer: Any) -> dict[int, torch.Tensor]:
    """{id(param): its fp32 master} from DeepSpeed's mixed-precision optimizer at ZeRO-0 (its
    `fp16_groups` / `fp32_groups`, kept side by side; empty for other optimizers)."""
    low, high = getattr(optimizer, "fp16_groups", None), getattr(optimizer, "fp32_groups", None)
    if not low or not high:
        return {}
    return {id(p): m for lows, highs in zip(low, high) for p, m in zip(lows, highs) if p.shape == m.shape}


def load_whole(module: nn.Module, zero3: bool, state: dict[str, Any], rank: int = 0) -> None:
    """Load complete weights into `module`. Under ZeRO-3 one module's parameters are gathered at
    a time (never the whole model on a rank) and rank 0's values are the ones used; a layer that
    tensor parallelism split is made whole, loaded on every rank and split again. Buffers are
    loaded on every rank. Keys and whole shapes must match exactly, as `load_state_dict(strict=True)`.
    `rank`: this process's global rank."""
    deepspeed = deepspeed_globals.load()

    expert_parallel.refuse_whole_weights(module)
    entries = module.state_dict(keep_vars=True)
    mismatch = _mismatch(entries, state)
    if mismatch:
        raise CheckpointError(
            f"the weights do not fit {type(module).__name__}: {mismatch}; load weights saved from this "
            "model (the same model.* config)"
        )
    split = any(getattr(p, "ds_is_replaced_module", False) for p in module.parameters())
    if not zero3 and not split:
        module.load_state_dict(state, strict=True)
        return
    key_of: dict[int, str] = {}
    for key, value in entries.items():
        key_of.setdefault(id(value), key)  # a tied parameter: loaded once, from its first key
    with torch.no_grad():
        for sub in module.modules():
            own = [p for p in sub.parameters(recurse=False) if id(p) in key_of]
            with deepspeed.zero.GatheredParameters(own, modifier_rank=0, enabled=zero3 and bool(own)):
                with _split_again(sub, own):
                    for p in own:
                        key = key_of.pop(id(p))
                        if rank == 0 or split:  # tensor parallel: every rank writes (the same dict)
                            _copy_checked(p, state[key], key)
        for key in key_of.values():  # buffers (never partitioned)
            _copy_checked(entries[key], state[key], key)


@contextlib.contextmanager
def _split_again(module: nn.Module, params: Sequence[torch.Tensor]) -> Iterator[None]:
    """A layer that tensor parallelism split is whole for the duration, then this rank's slice of
    what was written goes back into the parameter's own storage (a view into ZeRO 1/2's flat
    buffer, which the optimizer reads: a new tensor in `p.data` would fall out of training)."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    kept = [p.data for p in params]
    with GatherReplacedLayerParams(params, module, enabled=bool(params)):
        yield
    for p, data in zip(params, kept):
        if p.data is not data:
            data.copy_(p.data)
            p.data = data


def _mismatch(entries: dict[str, Any], state: dict[str, Any]) -> str | None:
    """Which keys the weights lack or add and which shapes differ (a few of each), or None."""

    def shown(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    missing, unexpected = sorted(set(entries) - set(state)), sorted(set(state) - set(entries))
    shapes = {k: tuple(whole_shape(v)) for k, v in entries.items()}
    wrong = [k for k in shapes if k in state and tuple(getattr(state[k], "shape", ())) != shapes[k]]
    parts = [f"missing {shown(missing)}"] if missing else []
    parts += [f"unexpected {shown(unexpected)}"] if unexpected else []
    parts += [
        f"{k} has shape {tuple(state[k].shape)} in the file, {shapes[k]} in the model" for k in wrong[:2]
    ]
    parts += [f"{len(wrong) - 2} more shapes differ"] if len(wrong) > 2 else []
    return "; ".join(parts) or None


def _copy_checked(target: torch.Tensor, value: torch.Tensor, key: str) -> None:
    if tuple(value.shape) != tuple(target.shape):
        raise RuntimeError(
            f"size mismatch for {key}: the weights have shape {tuple(value.shape)}, the model {tuple(target.shape)}"
        )
    target.copy_(value)


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
    process = runtime.start()
    with watchdog.suspended(watchdog.LONG_WORK, "writing the weights"):
        state = runtime.full_state_dict()
        weights = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        if process.is_main:
            module = runtime.module
            if not Path(path).suffix and is_hf_model(module):
                module.config.architectures = [type(module).__name__]
                module.save_pretrained(str(path), state_dict=weights, safe_serialization=True)
            else:
                save_weights(weights, path)
        process.barrier(slow=True)
    return Path(path)


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Read what `save_weights` wrote (no code is executed from the file)."""
    path = Path(path)
    safetensors = path.suffix == ".safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such weights file")
    try:
        if safetensors:
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        needs = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f" (it calls {needs.group(1)})" if needs else ""
        raise CheckpointError(
            f"{path} would run code when loaded{what}; refusing to load it: load weights only from a "
            "source you trust, saved as .safetensors or a state dict of tensors"
        ) from None
    except Exception as exc:  # noqa: BLE001 - not such a file, truncated, a header that lies, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        kind = "a safetensors file" if safetensors else "a torch state dict"
        hint = "; a torch file needs another suffix (.pt)" if safetensors else ""
        raise CheckpointError(f"{path} cannot be read as {kind} ({first}){hint}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} is not a state dict of tensors ({type(state).__name__})")
    return state
