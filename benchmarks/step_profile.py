"""What explains a step's time, for the rows of `benchmarks.gpu_bench`: a profile of a few steps
after the measured window (so it never slows the measured ones). Read from the profiler's events:
how much of the wall time some kernel ran (the rest are gaps where the GPU waited), the kernels
that took the most time, and how long the host waited for the device (synchronising CUDA calls).
"""

from __future__ import annotations

import time
from typing import Any

import torch

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


class StepProfile:
    """`start()` before the first profiled step, `stop(steps)` after the last."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.profiler = profile(activities=activities)
        self.began = 0.0
        self.summary: dict[str, Any] | None = None

    def start(self) -> None:
        """Begin recording (the device is idle: the caller has just waited for it)."""
        self.profiler.start()
        self.began = time.perf_counter()

    def stop(self, steps: int) -> None:
        """Wait for the device, stop recording, summarise per step."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.began
        self.profiler.stop()
        self.summary = summarise(self.profiler.events(), wall, steps)


def summarise(events: Any, wall_s: float, steps: int) -> dict[str, Any]:
    """Per step: wall ms, the share of it some kernel ran, the five kernels taking the most time
    (ms per step), and the host's synchronising CUDA calls (count and ms per step)."""
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy_us, reach = 0.0, float("-inf")
    for start, end in intervals:  # the union of kernel intervals
        if end > reach:
            busy_us += end - max(start, reach)
            reach = end
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    syncs = [e for e in events if e.device_type.name == "CPU" and e.name.startswith(SYNC_CALLS)]
    sync_us = sum(e.time_range.end - e.time_range.start for e in syncs if "Async" not in e.name)
    return {
        "step_ms": wall_s * 1000 / steps,
        "gpu_busy": busy_us / 1e6 / wall_s if kernels else None,
        "top_kernels_ms": [(name[:80], us / 1000 / steps) for name, us in top],
        "host_sync_calls": sum(1 for e in syncs if "Async" not in e.name) / steps,
        "host_sync_ms": sync_us / 1000 / steps,
    }


def line(summary: dict[str, Any] | None) -> str:
    """One line for the Markdown: step time, GPU busy share, host waits, the top kernel."""
    if not summary:
        return ""
    busy = "—" if summary["gpu_busy"] is None else f"{summary['gpu_busy']:.0%}"
    parts = [
        f"{summary['step_ms']:.0f} ms/step",
        f"GPU busy {busy}",
        f"host waits {summary['host_sync_calls']:.0f}x {summary['host_sync_ms']:.1f} ms/step",
    ]
    if summary["top_kernels_ms"]:
        name, ms = summary["top_kernels_ms"][0]
        parts.append(f"top kernel {name[:40]} {ms:.1f} ms/step")
    return ", ".join(parts)
