"""What every row of `benchmarks.gpu_bench` shares: the Llama-style model, its token data, the
FLOPs of a token, the device's peak, and a clock that reads the device only at the edges of the
measured window.

Sizes: `1b` is a Llama decoder of ~0.95 B parameters (16 layers, width 2048, MLP 5632, 16 heads,
vocabulary 32000), random init from a `transformers.LlamaConfig`, SDPA attention; `smoke` is the
same architecture small enough for two CPU cores.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

# Process start, as the parent stamped it (time to first step is measured from here).
T0 = float(os.environ.get("BENCH_T0", time.time()))

SIZES: dict[str, dict[str, int]] = {
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 32000,
    },
    "smoke": {
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 256,
    },
}


@dataclass(frozen=True)
class Setup:
    """One benchmark's fixed settings (the same for every row, ours, raw and peers)."""

    size: str = "1b"
    seq: int = 2048
    micro_batch: int = 8
    warmup: int = 3  # optimizer steps before the measured window
    steps: int = 8  # optimizer steps measured
    profile_steps: int = 2  # after the measured ones, under the profiler (benchmarks/step_profile.py)
    lr: float = 1e-4

    @property
    def total_steps(self) -> int:
        """Steps up to the end of the measured window."""
        return self.warmup + self.steps

    @property
    def run_steps(self) -> int:
        """Steps each row trains (the profiled ones included)."""
        return self.total_steps + self.profile_steps

    def to_dict(self) -> dict[str, Any]:
        """Plain form, for the child process and the JSON."""
        return asdict(self)


SMOKE = Setup(size="smoke", seq=64, micro_batch=4, warmup=1, steps=2)


def llama(setup: Setup, device: torch.device) -> torch.nn.Module:
    """A randomly initialised Llama causal LM of `setup.size`, built on `device` (fp32 weights: the
    DeepSpeed config's bf16 section casts them, and keeps fp32 masters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **SIZES[setup.size],
        max_position_embeddings=setup.seq,
        attn_implementation="sdpa",
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config)


class TokenData(torch.utils.data.Dataset):
    """Random token ids as a causal LM's dict batches (`labels` = `input_ids`; the model shifts)."""

    def __init__(self, setup: Setup, vocab_size: int):
        g = torch.Generator().manual_seed(0)
        n = setup.micro_batch * (setup.run_steps + 2)
        self.ids = torch.randint(0, vocab_size, (n, setup.seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def flops_per_token(model: torch.nn.Module, seq: int) -> float:
    """6 N + 12 L d T: weights forward and backward, plus attention (the framework's formula).
    Counted on the whole model, before ZeRO-3 partitions it."""
    from framework.observe.throughput import transformer_shape

    shape = transformer_shape(model)
    assert shape is not None
    layers, width = shape
    return float(6 * count_params(model) + 12 * layers * width * seq)


def count_params(model: torch.nn.Module) -> int:
    """Parameters of the whole model (before ZeRO-3 partitions it)."""
    return sum(p.numel() for p in model.parameters())


def peak_flops() -> float | None:
    """The GPU's dense bf16 peak (spec sheet, `framework.observe.throughput`), None on a CPU."""
    from framework.observe.throughput import gpu_peak

    if not torch.cuda.is_available():
        return None
    return gpu_peak(torch.cuda.get_device_name(0), torch.bfloat16, tf32=True)


def sync() -> None:
    """Wait for the device (nothing on a CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Clock:
    """Call `step()` after each optimizer step. The device is waited for only after the first
    step (time to first step), at the start and at the end of the measured window; the steps after
    it run under the profiler."""

    def __init__(self, setup: Setup):
        from benchmarks.step_profile import StepProfile

        self.setup = setup
        self.count = 0
        self.first_step_s = float("nan")
        self.start = self.end = float("nan")
        self.profile = StepProfile() if setup.profile_steps else None

    def step(self) -> None:
        """One optimizer step was issued."""
        self.count += 1
        if self.count == 1:
            sync()
            self.first_step_s = time.time() - T0
        if self.count == self.setup.warmup:
            sync()
            self.start = time.perf_counter()
        if self.count == self.setup.total_steps:
            sync()
            self.end = time.perf_counter()
            if self.profile:
                self.profile.start()
        if self.profile and self.count == self.setup.run_steps:
            self.profile.stop(self.setup.profile_steps)

    def result(self, flops_per_token: float) -> dict[str, Any]:
        """Tokens/s, MFU, peak memory and time to first step of the window."""
        setup = self.setup
        if self.count < setup.run_steps:
            raise RuntimeError(f"trained {self.count} of {setup.run_steps} steps")
        tokens_per_s = setup.steps * setup.micro_batch * setup.seq / (self.end - self.start)
        peak = peak_flops()
        return {
            "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * flops_per_token / peak if peak else None,
            "peak_mem_GB": peak_memory_bytes() / 2**30,
            "first_step_s": self.first_step_s,
            "profile": self.profile.summary if self.profile else None,
        }


def peak_memory_bytes() -> int:
    """Peak GPU memory allocated by torch in this process; on a CPU the peak resident set."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
