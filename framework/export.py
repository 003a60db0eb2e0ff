"""Consolidated fp32 weights from a checkpoint, loadable into the plain `nn.Module`.

    python -m framework.export CKPT_DIR OUT     # CKPT_DIR: a checkpoints dir (newest complete
                                                # checkpoint) or one checkpoint in it

ZeRO 1-3 shards are merged with DeepSpeed's own zero_to_fp32; a ZeRO-0 checkpoint already holds
whole weights. OUT gets safetensors (`.safetensors`) or a torch state dict (any other suffix);
`model.load_state_dict(load_weights(OUT), strict=True)` loads it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

import torch

from framework.checkpoint import store
from framework.errors import CheckpointError, ConfigError
from framework.weights import load_weights, save_weights


def fp32_state_dict(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a checkpoint (a checkpoints dir or one checkpoint)."""
    path = store.resolve(str(ckpt), None)
    if path is None:
        raise ConfigError(f"no complete checkpoint in {ckpt}")
    meta = store.check(path)
    if int(meta.get("pipeline_stages", 1)) > 1:
        raise ConfigError(
            f"{path} is a pipeline checkpoint: export it from Python with Engine.save(path, training=False), "
            "which maps the stages back onto the model"
        )
    if int(meta["zero_stage"]) == 0:
        states = torch.load(path / "mp_rank_00_model_states.pt", weights_only=True, map_location="cpu")
        return {k: v.float() if v.is_floating_point() else v for k, v in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):  # it prints progress
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name))


def main(argv: list[str] | None = None) -> int:
    """Command line: export CKPT_DIR to OUT."""
    parser = argparse.ArgumentParser(prog="python -m framework.export", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint", help="a checkpoints dir (its newest complete checkpoint) or one checkpoint"
    )
    parser.add_argument("out", help="output file: .safetensors, or a torch state dict for any other suffix")
    args = parser.parse_args(argv)
    try:
        out = save_weights(fp32_state_dict(args.checkpoint), args.out)
    except (ConfigError, CheckpointError) as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


__all__ = ["fp32_state_dict", "load_weights", "main", "save_weights"]

if __name__ == "__main__":
    sys.exit(main())
