"""DeepSpeed's own checkpoint formats, reached through DeepSpeed's own tools: the classes its files
may hold (for loads that cannot run code), its fp32 consolidation of ZeRO shards (zero_to_fp32),
its converter to the universal format (a command, run by `framework.checkpoint.store`), and the
split map AutoTP saves. `framework.checkpoint` and `framework.export` decide when; this says how."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path
from typing import Any

import torch


def allowed_classes() -> list[Any]:
    """The few non-tensor classes real DeepSpeed checkpoint files hold (ZeRO 0-3, bf16/fp16)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def zero_fp32_state_dict(ckpt_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """The whole fp32 weights of the ZeRO 1-3 checkpoint `ckpt_dir/tag` (DeepSpeed's zero_to_fp32;
    it prints progress, which is kept out of the user's console)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag))


def rebuild_split(entry: dict[str, Any], shards: dict[int, torch.Tensor]) -> torch.Tensor:
    """A whole parameter from its tensor-parallel shards (by rank) and the affine map AutoTP saved for it."""
    from deepspeed.checkpoint.affine import ParamAffineMap

    return ParamAffineMap.from_dict(entry).rebuild(shards)


def universal_command(source: Path, out: Path, zero_stage: int) -> list[str]:
    """The command that converts checkpoint `source` into DeepSpeed's universal format in `out`
    (ZeRO-2 checkpoints need the optimizer state DeepSpeed leaves out injected)."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source)]
    cmd += ["--output_folder", str(out)]
    if zero_stage == 2:
        cmd.append("--inject_missing_state")
    return cmd
