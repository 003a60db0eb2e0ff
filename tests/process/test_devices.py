"""The CUDA path, checked where a CPU can: exports from fp32 masters under mixed precision, rank
files that load on any device, no host sync in the framework's step path, skipped fp16 steps
counted without drift, the accelerator choice, gpu_check's overlap criterion
(tests/test_benchmarks.py runs the GPU check script itself on the CPU)."""

from __future__ import annotations

import collections
import functools
import os
import traceback
import types

import pytest
import torch

from framework import Callback, Engine, Strategy
from framework.backend.weights import load_weights
from framework.checkpoint import safety, store
from framework.data.datasets import synthetic
from framework.export import fp32_state_dict
from framework.models import MLP

from ..conftest import FAST, end_group, fails_cleanly, run_cmd, run_train, subprocess_env, torchrun

DATA = synthetic(num_samples=512)


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_exports_are_the_fp32_masters_not_bf16_rounded(stage, tmp_path):
    """Engine.save(training=False) and framework.export agree, and neither is rounded to bf16."""
    torch.manual_seed(0)
    engine = Engine(
        MLP(hidden=[32]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=1e-2),
        strategy=Strategy(sharding={"stage": stage}, amp={"enable": True, "dtype": "bf16"}),
    )  # fmt: skip
    engine.fit(DATA.train, epochs=1, batch_size=32, save_dir=str(tmp_path))
    engine.save(str(tmp_path / "w.safetensors"), training=False)
    saved, exported = load_weights(tmp_path / "w.safetensors"), fp32_state_dict(tmp_path)
    for key, value in saved.items():
        assert torch.equal(value, exported[key]), key
    weight = saved["features.0.weight"]
    assert weight.dtype == torch.float32 and not torch.equal(weight, weight.bfloat16().float())


def test_rank_files_hold_cpu_tensors_and_only_this_ranks_device_generator(tmp_path):
    engine = Engine(
        MLP(hidden=[32]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
        __import__("torchmetrics").classification.MulticlassAccuracy(num_classes=10),
    )  # fmt: skip
    engine.fit(DATA.train, epochs=1, batch_size=32, save_dir=str(tmp_path))
    rank_file = store.rank_file(store.find_resumable(tmp_path), 0)
    state = safety.load_safely(rank_file)
    tensors = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(state)
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    assert set(state["rng"]) == {"python", "numpy", "torch", "device"}  # not every GPU's generator
    assert state["metrics"]["train"]["metrics"]["accuracy"]


class _CountSyncs(Callback):
    """Counts host reads of tensor values made by framework code during steps that are not
    logging points (on CUDA each would wait for the device)."""

    def __init__(self):
        self.calls: collections.Counter = collections.Counter()
        self.active = False

    def on_step_start(self, state):
        self.active = state.global_step >= 2  # after the first steps (argument checks run once)

    def on_step_end(self, state):
        self.active = False


def test_no_host_sync_from_the_framework_in_the_step_path(monkeypatch):
    counter = _CountSyncs()
    originals = {
        name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__float__", "__bool__", "__int__")
    }

    def counting(name, fn):
        def wrapper(self, *args, **kwargs):
            if counter.active:
                frames = [f.filename for f in traceback.extract_stack(limit=8)[:-1]]
                if any("/framework/" in f for f in frames[-3:]):
                    counter.calls[(name, frames[-1])] += 1
            return fn(self, *args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        monkeypatch.setattr(torch.Tensor, name, counting(name, fn))
    for stage in (0, 3):
        torch.manual_seed(0)
        Engine(
            MLP(hidden=[32]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=1e-3),
            __import__("torchmetrics").classification.MulticlassAccuracy(num_classes=10),
            strategy=Strategy(sharding={"stage": stage}, gradient_merge={"k_steps": 2}), callbacks=[counter],
        ).fit(DATA.train, epochs=1, batch_size=32, log_freq=1000)  # fmt: skip
        counter.active = False
        end_group()
    assert not counter.calls, counter.calls


def test_no_device_sync_from_deepspeed_in_the_step_path(monkeypatch):
    """DeepSpeed's throughput timer synchronizes the device twice per micro-batch unless the
    config turns it off; a user's own `timers` section still wins (test_strategy)."""
    from deepspeed.accelerator import get_accelerator

    counter = _CountSyncs()
    accelerator = get_accelerator()
    real = accelerator.synchronize

    def counting(*args, **kwargs):
        if counter.active:
            counter.calls["synchronize", "".join(traceback.format_stack(limit=3)[:1])] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(accelerator, "synchronize", counting)
    for stage in (0, 2):
        torch.manual_seed(0)
        Engine(
            MLP(hidden=[32]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=1e-3),
            strategy=Strategy(sharding={"stage": stage}, gradient_merge={"k_steps": 2}), callbacks=[counter],
        ).fit(DATA.train, epochs=1, batch_size=32, max_steps=6, log_freq=1000)  # fmt: skip
        counter.active = False
        end_group()
    assert not counter.calls, counter.calls


def test_one_gpu_per_task_tells_deepspeed_the_device_it_sees(monkeypatch):
    """Slurm with one GPU per task: LOCAL_RANK 3, one visible GPU. DeepSpeed reads LOCAL_RANK as a
    device index itself (init_process_group's device_id, zero.Init), so the environment must name
    the device chosen here; the launcher's value is kept as the context's local_rank and comes back
    when it closes."""
    from framework import ProcessContext

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    ctx = ProcessContext("cuda", local_rank=3)
    ctx._share_device_index()
    assert ctx.device == torch.device("cuda", 0) and ctx.device_index == 0
    assert os.environ["LOCAL_RANK"] == "0" and ctx.local_rank == 3
    ctx.close()
    assert os.environ["LOCAL_RANK"] == "3"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # every GPU visible: nothing to change
    ctx = ProcessContext("cuda", local_rank=3)
    ctx._share_device_index()
    assert os.environ["LOCAL_RANK"] == "3" and ctx.device == torch.device("cuda", 3)


def test_zero3_on_the_cpu_starts_no_subprocess_per_step(monkeypatch):
    # DeepSpeed's CPU accelerator counts its devices from LOCAL_SIZE, else by running numactl,
    # which ZeRO-3 asks for every gradient bucket: the framework says the local size itself.
    import subprocess

    started = []

    def spy(cmd, *args, **kwargs):
        started.append(cmd)
        return real(cmd, *args, **kwargs)

    import platform

    platform.processor()  # asks `uname -p` once per process (cached): not a per-step subprocess
    real = subprocess.check_output
    monkeypatch.setattr(subprocess, "check_output", spy)
    torch.manual_seed(0)
    engine = Engine(
        MLP(hidden=[32]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=1e-3),
        strategy=Strategy(sharding={"stage": 3}),
    )  # fmt: skip
    engine.fit(DATA.train, epochs=1, batch_size=32, max_steps=3, log_freq=1000)
    assert started == [] and os.environ["LOCAL_SIZE"] == "1"
    engine.close()
    assert "LOCAL_SIZE" not in os.environ  # the framework's own setting goes with its context


_SLOW_WEIGHTS_SAVE = """
import functools, sys, time
from pathlib import Path
import torch
from framework import Engine
from framework.process import watchdog
from framework.backend import weights
from framework.models import MLP

out, real = Path(sys.argv[1]), weights.save_weights
weights.save_weights = lambda state, path: (time.sleep(3), real(state, path))[1]  # a large model
engine = Engine(MLP(hidden=[8]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1))
engine.prepare("train", batch_size=8)
watchdog.start(1.0, engine.process.rank)  # shorter than the write: the save must not count as a stall
engine.save(str(out / "w.safetensors"), training=False)
(out / f"rank{engine.process.rank}").write_text(str((out / "w.safetensors").exists()))
watchdog.stop()
engine.close()
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_consolidated_weights_save_waits_for_rank_0_without_a_stall(tmp_path):
    """What KeepBest and Control.save_weights call: rank 0 writes while the others wait for it
    (under nccl on the slow gloo group), with the watchdog off however long the write takes."""
    script = tmp_path / "save.py"
    script.write_text(_SLOW_WEIGHTS_SAVE)
    run = run_cmd([*torchrun(2), str(script), str(tmp_path)], timeout=150)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["True", "True"]


def test_skipped_fp16_steps_are_counted_and_never_advance_the_step(monkeypatch):
    """The loop's accounting of DeepSpeed's overflow skips (fp16 cannot run on this CPU): the
    losses of a skipped step are dropped, with or without accumulation, global_step counts
    applied steps only (what max_steps, checkpoint tags and the LR schedule follow)."""
    from framework.engine import epoch as loops
    from framework.observe.state import LoopState

    runtime = types.SimpleNamespace(global_steps=0, skipped_steps=0, lr=0.1)
    host = types.SimpleNamespace(runtime=runtime, state=LoopState(), train_step_fn=None)
    pending: list = []

    def call(loss, boundary, overflow):
        before, skipped = runtime.global_steps, runtime.skipped_steps
        pending.append(torch.tensor(loss))
        if boundary:
            runtime.global_steps += 1
            runtime.skipped_steps += int(overflow)
        loops._after_step(host, pending, before, skipped, log_freq=1000)

    call(1.0, True, False)  # step 1 applied
    call(float("inf"), False, False)  # accumulation: an overflowing micro-batch ...
    call(2.0, True, True)  # ... and its boundary: the scaler skipped the step
    call(3.0, True, False)  # step 2 applied
    st = host.state
    assert (st.global_step, st.skipped_steps) == (2, 1)
    assert [float(v) for v, _ in st.epoch_loss.pending] == [1.0, 3.0]  # the skipped step's losses are gone
    assert st.first_bad_loss() is None


@pytest.mark.slow
def test_accelerator_cuda_without_a_gpu_is_one_line(tmp_path):
    fails_cleanly(
        run_train(["trainer.accelerator=cuda", *FAST], tmp_path), "trainer.accelerator=cuda, but torch"
    )


def test_accelerator_cpu_tells_deepspeed_after_it_chose_cuda(monkeypatch):
    """DeepSpeed fixes its accelerator on import (CUDA on a GPU machine), before a run decides:
    choosing the CPU afterwards must switch DeepSpeed too, or the engine puts the weights on cuda:0
    while the framework's batches stay on the CPU."""
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    from framework.backend import deepspeed_globals

    before = get_accelerator()
    set_accelerator(CUDA_Accelerator())  # what `import deepspeed` picks on a GPU machine
    try:
        deepspeed_globals.use_accelerator("cpu")  # what a runtime on the CPU does when it starts
        assert get_accelerator().device_name() == "cpu"
    finally:
        set_accelerator(before)


@pytest.mark.slow
def test_accelerator_cpu_trains_on_the_cpu(tmp_path):
    # DS_ACCELERATOR=cuda makes DeepSpeed pick CUDA on import, as it does on a GPU machine (and as a
    # parent process that trained on the GPU leaves it): the run must still train on the CPU.
    env = subprocess_env(DS_ACCELERATOR="cuda")
    run = run_train(["trainer.accelerator=cpu", *FAST, "trainer.max_steps=2"], tmp_path, env=env)
    assert run.returncode == 0 and "process(es) on cpu" in run.stdout, run.stderr[-2000:]


def test_gpu_check_overlap_criterion_counts_batch_copies_beside_kernels():
    """The profiler criterion of gpu_check's `overlap`: batch copies (pinned host memory) on a side
    stream inside a kernel's time span count; one on the compute stream is named; pageable copies
    of scalars (DeepSpeed's, torch's) are not batch copies."""
    from benchmarks.gpu_overlap import copy_overlap

    def event(cat, ts, dur, stream, name="k"):
        return {"cat": cat, "ts": ts, "dur": dur, "name": name, "args": {"stream": stream}}

    pinned, pageable = "Memcpy HtoD (Pinned -> Device)", "Memcpy HtoD (Pageable -> Device)"
    events = [event("kernel", t, 9.0, 7) for t in range(100, 400, 10)]  # a busy compute stream
    events += [
        event("gpu_memcpy", 1, 1, 20, pinned),
        event("gpu_memcpy", 3, 1, 20, pinned),
    ]  # before any kernel
    events += [event("gpu_memcpy", 150, 2, 20, pinned), event("gpu_memcpy", 251, 1, 20, pinned)]
    events += [event("gpu_memcpy", 500, 1, 20, pinned)]  # after the last kernel
    events += [event("gpu_memcpy", 305, 1, 7, pinned), event("gpu_memcpy", 200, 1, 7, pageable)]
    stats = copy_overlap(events)
    assert stats == {
        "batch_copies": 6,
        "on_compute_stream": 1,
        "overlapping_a_kernel": 3,
        "batch_copies_after_first": 4,
        "other_h2d_copies": 1,
    }
