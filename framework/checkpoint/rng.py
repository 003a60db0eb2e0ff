"""This process's random number generators, as a checkpoint saves them and puts them back."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def state(device: torch.device) -> dict[str, Any]:
    """This process's generators: Python, NumPy, torch's CPU one and the one of `device` (this rank's)."""
    np_state: Any = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "device": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def restore(saved: dict[str, Any], device: torch.device) -> None:
    """Put back what `state` returned (the generator of `device` only on a device of that kind)."""
    random.setstate(_as_tuple(saved["python"]))
    np_state = saved["numpy"]
    np.random.set_state((np_state[0], np_state[1].numpy(), *np_state[2:]))
    torch.set_rng_state(saved["torch"])
    if saved.get("device") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(saved["device"], device)


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
