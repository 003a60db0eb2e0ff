"""How fast a run is: samples and tokens per second, model FLOPs per step, MFU, and where a
step's time goes. Everything is measured without a host sync in the step path and read at
logging points.

* FLOPs per optimizer step and rank: for a transformer whose shape is known (the framework's
  GPT, a Hugging Face causal LM) the standard count, 6 N + 12 L d T per token (N parameters, L
  layers, d width, T context: weights forward and backward, plus attention); otherwise counted
  over the run's first optimizer step (forward and backward of every micro-batch, as the step
  really computes them) by `FlopCount`, with the formulas of `torch.utils.flop_counter`.
  `flops_source` says which. The counted step computes what any other step computes, bit for
  bit: torch's own `FlopCounterMode` decomposes the operators it has no formula for (SiLU's
  backward, for one), which moved a resumed run's first step (the one counted there) by an ulp.
* Peak FLOP/s of one device: on CUDA from a table of dense peaks per GPU and dtype (TF32 for
  fp32 when it is on); `trainer.peak_tflops` overrides it. A CPU has no peak we can trust (a
  matmul probe read half the real rate while another rank or job shared the cores, and MFU then
  read 115-183 %), so on a CPU MFU is shown only with `trainer.peak_tflops`. An MFU above 100 %
  means the peak is wrong: it is left out of the logs and said once.
* The step's time: waiting for data (host clock), forward, backward and optimizer step (CUDA
  events on a GPU, the host clock on a CPU). Communication happens inside backward (gradient
  reduction) and the optimizer step (ZeRO-3 gathers); DeepSpeed does not expose it separately
  without its own synchronising timers.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

# Dense peak TFLOP/s per device, by name fragment (checked in order) and compute dtype.
# fp32 is the TF32 tensor-core rate (used when TF32 is on), fp32_plain the CUDA-core rate.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7, "fp32_plain": 66.9}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0, "fp32_plain": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7, "fp32_plain": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0, "fp32_plain": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "fp32": 183.0, "fp32_plain": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0, "fp32_plain": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "fp32": 62.5, "fp32_plain": 31.2}),
    ("4090", {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6, "fp32_plain": 82.6}),
    ("V100", {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7, "fp32_plain": 15.7}),
    ("T4", {"bf16": 0.0, "fp16": 65.0, "fp32": 8.1, "fp32_plain": 8.1}),
]


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def gpu_peak(name: str, dtype: torch.dtype, tf32: bool) -> float | None:
    """Dense peak FLOP/s of the GPU called `name` (None when not in the table)."""
    key = _dtype_name(dtype)
    if key == "fp32" and not tf32:
        key = "fp32_plain"
    for fragment, peaks in PEAK_TFLOPS:
        if fragment in name and peaks.get(key):
            return peaks[key] * 1e12
    return None


def transformer_shape(model: Any) -> tuple[int, int] | None:
    """(layers, width) of a transformer whose shape the model or its config says, else None."""
    config = getattr(model, "config", None)
    for source in (config, model):
        if source is None:
            continue
        layers = next(
            (getattr(source, k) for k in ("num_hidden_layers", "n_layer") if hasattr(source, k)), None
        )
        width = next((getattr(source, k) for k in ("hidden_size", "n_embd") if hasattr(source, k)), None)
        if isinstance(layers, int) and isinstance(width, int):
            return layers, width
    return None


def tokens_per_sample(batch: Any) -> int | None:
    """The sequence length of a batch of token ids (2-D integer inputs), else None."""
    first = (
        batch.get("input_ids")
        if isinstance(batch, dict)
        else (batch[0] if isinstance(batch, (tuple, list)) else batch)
    )
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return None


class PhaseTimer:
    """Time spent per phase of the steps since the last `read()`, without waiting for the device:
    on CUDA, events recorded on the compute stream and read at the next `read()`."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.spans: list[tuple[str, Any, Any]] = []
        self.host: dict[str, float] = {}

    def now(self) -> Any:
        """A point in time: an event on CUDA, the host clock otherwise."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, name: str, start: Any, end: Any) -> None:
        """The span `start` -> `end` belongs to `name`."""
        self.spans.append((name, start, end))

    def add_host(self, name: str, seconds: float) -> None:
        """Host time (e.g. waiting for data) spent in `name`."""
        self.host[name] = self.host.get(name, 0.0) + seconds

    def read(self) -> dict[str, float]:
        """Milliseconds per phase since the last read (on CUDA: waits for the last event only)."""
        totals = {name: seconds * 1000 for name, seconds in self.host.items()}
        if self.spans and self.cuda:
            self.spans[-1][2].synchronize()
        for name, start, end in self.spans:
            ms = start.elapsed_time(end) if self.cuda else (end - start) * 1000
            totals[name] = totals.get(name, 0.0) + ms
        self.spans, self.host = [], {}
        return totals


class FlopCount(TorchDispatchMode):
    """While active: the FLOPs of every operator that runs, from `torch.utils.flop_counter`'s
    formulas (matmuls, convolutions, attention), each operator run as it is (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_counter.flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        elif func._overloadpacket is _CPU_ATTENTION:  # (query, key, value, ...)
            self.flops += flop_counter.sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)
        elif func._overloadpacket is _CPU_ATTENTION_BACKWARD:  # (grad_out, query, key, value, ...)
            shapes = [a.shape for a in args[:4]]
            self.flops += flop_counter.sdpa_backward_flop_count(*shapes)
        return out


# torch has no formula for its CPU attention kernels; they compute what the flash kernel's count
_CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class Speedometer:
    """Throughput, MFU and phase times per logging interval of one `fit`."""

    def __init__(self, runtime: Any, global_batch_size: int, peak_tflops: float | None = None):
        self.runtime, self.global_batch = runtime, global_batch_size
        self.cuda = runtime.cuda
        self.timer = PhaseTimer(self.cuda)
        runtime.timer = self.timer
        self.tokens: int | None = None  # per sample
        self.flops_per_step: float | None = None  # per rank
        self.source = ""
        self.measured = False
        self._counter: FlopCount | None = None  # while the first optimizer step is counted
        self._count_from = 0
        self.peak = peak_tflops * 1e12 if peak_tflops else self._device_peak()
        self.since, self.steps_at = time.perf_counter(), 0
        self._over_peak_said = not runtime.process.is_main

    def _device_peak(self) -> float | None:
        """The GPU's peak from the table; None on a CPU (see the module doc)."""
        if not self.cuda:
            return None
        name = torch.cuda.get_device_name(self.runtime.device)
        return gpu_peak(name, self.runtime.compute_dtype, torch.backends.cuda.matmul.allow_tf32)

    def measure(self, batch: Any, step: int) -> None:
        """From the first batch (every rank, together): tokens per sample, and the FLOPs per
        optimizer step by the formula, or else a counter for `counting` to run the first step under."""
        self.since, self.steps_at, self.measured = time.perf_counter(), step, True
        runtime = self.runtime
        self.tokens = tokens_per_sample(batch)
        per_step = (
            runtime.layout.micro_batch_size if runtime.layout else 1
        ) * runtime.strategy.accumulation_steps
        shape = transformer_shape(runtime.module)
        if shape is not None and self.tokens:
            layers, width = shape
            per_token = 6 * runtime.parameters + 12 * layers * width * self.tokens
            # a rank's share: its pipeline stage, its tensor- / sequence-parallel part of each layer
            split = runtime.strategy.pipeline.stages * runtime.mesh.mp_size
            self.flops_per_step = per_token * self.tokens * per_step / split
            self.source = "formula: 6 N + 12 L d T per token"
        elif not runtime.strategy.uses_pipeline:
            self._counter = FlopCount()
            self._count_from = runtime.global_steps

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Run a step call under the FLOP counter until the first optimizer step is done: what
        the real step computes (forward, backward, any extra passes a custom step makes), with no
        pass of its own that ZeRO-3 would record as part of the model's order of use."""
        counter = self._counter
        if counter is None:
            yield
            return
        with counter:  # its count adds up over the calls of the first optimizer step
            yield
        steps = self.runtime.global_steps - self._count_from
        if steps > 0:
            self.flops_per_step, self._counter = counter.flops / steps, None
            self.source = "counted over the first optimizer step"

    def logs(self, step: int) -> dict[str, float]:
        """Numbers for the interval since the last call (reads the device's timing events)."""
        now = time.perf_counter()
        seconds, steps = max(now - self.since, 1e-9), max(step - self.steps_at, 1)
        self.since, self.steps_at = now, step
        out: dict[str, float] = {"samples_per_s": self.global_batch * steps / seconds}
        if self.tokens:
            out["tokens_per_s"] = out["samples_per_s"] * self.tokens
        if self.flops_per_step and self.peak:
            mfu = self.flops_per_step * steps / seconds / self.peak
            if mfu <= 1.0:
                out["mfu"] = mfu
            elif not self._over_peak_said:
                self._over_peak_said = True
                print(
                    f"warning: MFU left out: it would read {100 * mfu:.0f} %, so the peak of "
                    f"{self.peak / 1e12:,.3g} TFLOP/s per device is too low (trainer.peak_tflops)",
                    file=sys.stderr,
                    flush=True,
                )
        phases = self.timer.read()
        if "forward" in phases:  # the step call includes the time it waited for its batches
            phases["forward"] = max(phases["forward"] - phases.get("data", 0.0), 0.0)
        for phase, ms in phases.items():
            out[f"time_{phase}_ms"] = ms / steps
        return out
