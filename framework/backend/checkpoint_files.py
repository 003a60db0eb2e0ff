"""DeepSpeed's own checkpoint formats, reached through DeepSpeed's own tools: the classes its files
may hold (for loads that cannot run code), its fp32 consolidation of ZeRO shards (zero_to_fp32),
its converter to the universal format (a command, run by `framework.checkpoint.store`), and the
split map AutoTP saves. `framework.checkpoint` and `framework.export` decide when; this says how."""

from __future__ import annotations

import contextlib
import io
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from framework.errors import CheckpointError


def allowed_classes() -> list[Any]:
    """The few non-tensor classes real DeepSpeed checkpoint files hold (ZeRO 0-3, bf16/fp16)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def zero_fp32_state_dict(ckpt_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """The whole fp32 weights of the ZeRO 1-3 checkpoint `ckpt_dir/tag` (DeepSpeed's zero_to_fp32;
    it prints progress, on stdout and as tqdm bars on stderr, which is kept out of the user's console)."""
    from deepspeed.utils import zero_to_fp32

    bars = zero_to_fp32.tqdm
    zero_to_fp32.tqdm = lambda iterable, **_: iterable  # its progress bars (newer 0.19.x), not its errors
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return dict(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag))
    finally:
        zero_to_fp32.tqdm = bars


def rebuild_split(entry: dict[str, Any], shards: dict[int, torch.Tensor]) -> torch.Tensor:
    """A whole parameter from its tensor-parallel shards (by rank) and the affine map AutoTP saved for it."""
    from deepspeed.checkpoint.affine import ParamAffineMap

    return ParamAffineMap.from_dict(entry).rebuild(shards)


def universal_command(source: Path, out: Path, zero_stage: int) -> list[str]:
    """The command that converts checkpoint `source` into DeepSpeed's universal format in `out`
    (ZeRO-1/2 checkpoints lack the `universal_checkpoint_info` DeepSpeed's converter asserts, which
    only Megatron-style clients write: it is injected, empty, as for a model without TP patterns)."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source)]
    cmd += ["--output_folder", str(out)]
    if zero_stage in (1, 2):
        cmd.append("--inject_missing_state")
    return cmd


ADAM_STATES = ("exp_avg", "exp_avg_sq")  # the per-parameter states DeepSpeed's converter and loaders carry
STATE_NAMES = "optimizer_state_names.json"  # in a conversion staged by `adam_shaped`: what to put back


def adam_shaped(source: Path, staging: Path) -> dict[str, Any] | None:
    """DeepSpeed's universal converter and its ZeRO-3 loader know Adam's two per-parameter states
    only (`KeyError: 'exp_avg'` for SGD). When the optimizer that saved ZeRO checkpoint `source`
    keeps others (SGD: `momentum_buffer`, or none), copies of its DeepSpeed files go to `staging`
    with those states under Adam's names (zeros for a name left over, a `step` where it keeps
    none). Returns what `restore_state_names` puts back after loading ({"names": {Adam's: its},
    "step": whether it keeps a step}); None when nothing needed staging. An optimizer with more
    than two states cannot be carried: CheckpointError."""
    files = sorted(source.glob("*_optim_states.pt"))
    optims = [_load(file) for file in files]
    names: list[str] = []
    for optim in optims:
        for state in _state_and_fp32(optim)[0]["state"].values():
            names += [k for k in state if k != "step" and k not in names and torch.is_tensor(state[k])]
    if sorted(names) == sorted(ADAM_STATES):
        return None
    if len(names) > len(ADAM_STATES):
        raise CheckpointError(
            f"checkpoint {source} holds {len(names)} optimizer states per parameter ({', '.join(names)}); "
            "DeepSpeed's conversion for another number of processes carries two (Adam's): resume it on "
            "the number of processes that saved it"
        )
    rename = dict(zip(ADAM_STATES, names))
    steps = any("step" in s for optim in optims for s in _state_and_fp32(optim)[0]["state"].values())
    staging.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():  # the model states (a pipeline's layer files too), as they are
        if file.is_file() and file not in files:
            shutil.copy(file, staging / file.name)
    for file, optim in zip(files, optims):
        base, fp32 = _state_and_fp32(optim)
        base["state"] = {g: _as_adam(base["state"].get(g, {}), rename, flat) for g, flat in enumerate(fp32)}
        torch.save(optim, staging / file.name)
    return {"names": rename, "step": steps}


def restore_state_names(optimizer: Any, staged: dict[str, Any]) -> None:
    """After a load from a conversion `adam_shaped` staged: the optimizer's own state names back,
    the zeros and the `step` that were there for DeepSpeed's sake gone."""
    own = staged["names"]
    for state in optimizer.state.values():
        kept = {
            own.get(key, key): value
            for key, value in state.items()
            if key in own or (key not in ADAM_STATES and (key != "step" or staged["step"]))
        }
        state.clear()
        state.update(kept)


def _load(file: Path) -> dict[str, Any]:
    with torch.serialization.safe_globals(allowed_classes()):
        return torch.load(file, map_location="cpu", weights_only=True)


def _state_and_fp32(optim: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """(the torch optimizer's state dict, the fp32 partition of each group) in one rank's ZeRO file."""
    zero = optim["optimizer_state_dict"]
    if "base_optimizer_state" in zero:  # ZeRO-1/2
        return zero["base_optimizer_state"], zero["single_partition_of_fp32_groups"]
    return zero["optimizer_state_dict"], zero["fp32_flat_groups"]  # ZeRO-3


def _as_adam(state: dict[str, Any], rename: dict[str, str], fp32: torch.Tensor) -> dict[str, Any]:
    adam = {name: state[rename[name]] if name in rename else torch.zeros_like(fp32) for name in ADAM_STATES}
    return {"step": state.get("step", torch.tensor(0.0)), **adam}
