"""gpu_check's `overlap` check: batch copies run beside compute, not between it.

The framework copies each batch from pinned memory on a side stream, started by the prefetch
thread, so that the next batch's copy runs while this step's kernels do. On a model whose step
keeps the GPU busy (a GPT of ~100 M parameters, a step of tens of milliseconds) the profiler then
shows every batch copy on a stream other than the compute stream and, after the first, inside the
time span of some kernel. The first H200 run checked this on a 0.1 M-parameter MLP, whose step
leaves the GPU idle most of the time, and counted every host-to-device copy (DeepSpeed's and
torch's small pageable copies of scalars, which run on the compute stream by design): there no
copy can overlap a kernel, whatever the copier does, so that criterion said nothing.
"""

from __future__ import annotations

import bisect
import collections
import functools
import json
import tempfile
from typing import Any

import torch

# The model and batch: a step long enough that the GPU is busy while the next batch is copied.
GPU_SIZE = {"n_layer": 8, "n_embd": 1024, "n_head": 16, "block_size": 512, "vocab_size": 8192, "batch": 16}
CPU_SIZE = {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32, "vocab_size": 128, "batch": 8}


def _engine(size: dict[str, int], prefetch: int, callbacks: list[Any]) -> Any:
    from framework import Engine
    from framework.models import GPT, LMLoss

    torch.manual_seed(0)
    model = GPT(**{k: v for k, v in size.items() if k != "batch"})
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-4)
    return Engine(model, LMLoss(), optimizer, prefetch=prefetch, callbacks=callbacks)


def _fit(engine: Any, size: dict[str, int], steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(
        0, size["vocab_size"], (size["batch"] * (steps + 2), size["block_size"] + 1), generator=g
    )
    data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
    engine.fit(data, epochs=10, batch_size=size["batch"], max_steps=steps, log_freq=10**6, progress=False)


def copy_overlap(events: list[dict[str, Any]]) -> dict[str, Any]:
    """From a Chrome trace's GPU events: the batch copies (host-to-device from pinned memory),
    how many ran on the compute stream (the stream of most kernels), and how many overlapped a
    kernel in time; the other host-to-device copies are counted apart."""
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    streams = collections.Counter(e["args"].get("stream") for e in events if e.get("cat") == "kernel")
    compute = streams.most_common(1)[0][0] if streams else None
    h2d = sorted(
        (e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")),
        key=lambda e: e["ts"],
    )
    batch = [e for e in h2d if "Pinned" in e["name"]]
    longest = max((end - start for start, end in kernels), default=0.0)
    starts = [start for start, _ in kernels]

    def overlaps(e: dict[str, Any]) -> bool:
        begin, end = e["ts"], e["ts"] + e["dur"]
        first = bisect.bisect_left(starts, begin - longest)  # kernels that may still run at `begin`
        last = bisect.bisect_right(starts, end)
        return any(k_end > begin for _, k_end in kernels[first:last])

    after_first = batch[2:]  # the first batch (x and y) is copied before any kernel runs
    return {
        "batch_copies": len(batch),
        "on_compute_stream": sum(1 for e in batch if e["args"].get("stream") == compute),
        "overlapping_a_kernel": sum(1 for e in after_first if overlaps(e)),
        "batch_copies_after_first": len(after_first),
        "other_h2d_copies": len(h2d) - len(batch),
    }


def _profile(size: dict[str, int], steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    engine = _engine(size, prefetch=2, callbacks=[])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _fit(engine, size, steps)
    engine.close()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    return copy_overlap([e for e in events if e.get("ph") == "X"])


def check_overlap(cuda: bool, steps: int) -> dict[str, Any]:
    """Batch copies on a side stream, overlapping kernels (profiler, a ~100 M GPT), and prefetch 2
    no slower than prefetch 0 per step."""
    from benchmarks.common import StepTimes, median

    size = GPU_SIZE if cuda else CPU_SIZE
    times = {}
    for depth in (0, 2):
        timer = StepTimes()
        engine = _engine(size, depth, [timer])
        _fit(engine, size, steps + 3)
        times[depth] = median(timer.times)
        engine.close()
    detail: dict[str, Any] = {"step_ms": {k: round(v * 1000, 2) for k, v in times.items()}}
    if not cuda:  # nothing to copy on the CPU: the loop ran, the timing says nothing about overlap
        return {"ok": True, "skipped": True, "detail": detail}
    stats = _profile(size, 8)
    detail.update(stats)
    # Most, not all: a copy issued while the GPU waits for the host (the first steps, a logging
    # point) has nothing to overlap; a copier that copied on the compute stream, or between
    # steps, would overlap none.
    overlapping = stats["overlapping_a_kernel"] >= 0.5 * stats["batch_copies_after_first"]
    ok = (
        stats["batch_copies"] >= 2 * 8
        and stats["on_compute_stream"] == 0
        and overlapping
        and times[2] <= times[0] * 1.05
    )
    return {"ok": ok, "detail": detail}
