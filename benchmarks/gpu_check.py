"""One prepared check of the CUDA path: about 5 minutes on one GPU, no network.

    python -m benchmarks.gpu_check            # on a machine with a GPU
    python -m benchmarks.gpu_check --smoke    # the same script on the CPU (the test suite runs it)

Each check prints one line and lands in `gpu_check.json` (under --out-dir, else a temporary dir for
--smoke, else $OUT when set, else benchmarks/results/); the exit status is non-zero when any check
fails. Checks that need a GPU (nccl, fp16, sync debugging, copy/compute overlap) are marked skipped
on the CPU.

1. placement: backend, DeepSpeed's accelerator, model / batch / metric state on the device
2. ZeRO 0-3 (and ZeRO-3 + offload on a GPU): finite, falling losses; ZeRO-0/1/2 equal, ZeRO-3 within 1e-4
3. bf16 and fp16 at ZeRO 0/2/3: finite, falling losses; model(x) casts a fresh fp32 input once written
4. an injected fp16 overflow skips exactly one step, with and without accumulation; step and LR agree
5. checkpoint, resume and export on the device; a rank file saved there loads in a CPU-only process
6. no host sync per training step outside logging steps (torch.cuda.set_sync_debug_mode)
7. batch copies run on a side stream beside the kernels of a ~100 M GPT (profiler; benchmarks/gpu_overlap.py),
   and prefetch 2 is no slower than prefetch 0
8. device memory per ZeRO stage for a ~25 M GPT next to Engine.cost()
9. train.py end to end on the device; trainer.accelerator=cpu on the same machine trains on the CPU
"""

from __future__ import annotations

import functools
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, machine, parse_args, quiet
from benchmarks.gpu_overlap import check_overlap

ROOT = Path(__file__).resolve().parents[1]


def _engine(
    stage: int = 0, amp: str | None = None, k_steps: int = 1, offload: bool = False, **kwargs: Any
) -> Any:
    from framework import Engine, Strategy
    from framework.models import MLP

    torch.manual_seed(0)
    strategy = Strategy(
        sharding={"stage": stage, "offload_optimizer": offload, "offload_params": offload and stage == 3},
        amp={"enable": amp is not None, "dtype": amp or "bf16"},
        gradient_merge={"k_steps": k_steps},
    )
    return Engine(
        MLP(),
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.AdamW, lr=3e-3),
        strategy=strategy,
        **kwargs,
    )


def _fit_losses(engine: Any, steps: int, **kwargs: Any) -> list[float]:
    from framework.data.datasets import digits

    train, _ = digits()
    history: list[float] = []

    class Record:
        def on_event(self, event: Any, state: Any, control: Any = None) -> None:
            if event.value == "step_end" and "loss" in state.logs:
                history.append(float(state.logs["loss"]))

    engine.fit(
        train,
        epochs=100,
        batch_size=64,
        max_steps=steps,
        log_freq=1,
        callbacks=[Record()],
        progress=False,
        **kwargs,
    )
    return history


def _falling(losses: list[float]) -> bool:
    return all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def _teardown() -> None:
    from benchmarks.common import end_job

    end_job()


# ------------------------------------------------------------------------------------------ checks


def check_placement(cuda: bool, steps: int) -> dict[str, Any]:
    """Backend, DeepSpeed's accelerator and where the model, a batch and the metrics live."""
    import torchmetrics
    from deepspeed.accelerator import get_accelerator

    from framework.data.datasets import digits

    engine = _engine(metrics=torchmetrics.classification.MulticlassAccuracy(num_classes=10))
    loader = engine.dataloader(digits()[0], batch_size=64, mode="train")
    batch = next(iter(loader))
    engine.run(batch, mode="train")
    want = "cuda" if cuda else "cpu"
    found = {
        "backend": engine.process.backend,
        "accelerator": get_accelerator().device_name(),
        "model": str(next(engine.module.parameters()).device),
        "batch": str(batch[0].device),
        "metric": str(next(iter(engine.metrics.train.metrics.values())).tp.device),
    }
    _teardown()
    ok = found["backend"] == ("nccl" if cuda else "gloo") and all(
        v.startswith(want) for k, v in found.items() if k != "backend"
    )
    return {"ok": ok, "detail": found}


def check_zero_stages(cuda: bool, steps: int) -> dict[str, Any]:
    """ZeRO 0-3 (+ offload on a GPU) train; 0/1/2 agree exactly, 3 within 1e-4."""
    runs = {}
    for stage in (0, 1, 2, 3):
        runs[f"zero{stage}"] = _fit_losses(_engine(stage), steps)
        _teardown()
    if cuda:
        runs["zero3_offload"] = _fit_losses(_engine(3, offload=True), steps)
        _teardown()
    base = runs["zero0"]
    close = {
        name: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, base))
        for name, losses in runs.items()
    }
    ok = (
        all(_falling(v) for v in runs.values())
        and all(close[f"zero{s}"] <= 1e-6 for s in (1, 2))
        and close["zero3"] <= 1e-4
    )
    return {
        "ok": ok,
        "detail": {"max_rel_diff_vs_zero0": close, "first_last": {k: (v[0], v[-1]) for k, v in runs.items()}},
    }


def check_mixed_precision(cuda: bool, steps: int) -> dict[str, Any]:
    """bf16 (and fp16 on a GPU) at ZeRO 0/2/3: finite, falling losses."""
    dtypes = ["bf16", "fp16"] if cuda else ["bf16"]
    runs, inputs_cast_after_written = {}, {}
    for dtype in dtypes:
        for stage in (0, 2, 3):
            engine = _engine(stage, amp=dtype)
            runs[f"{dtype}_zero{stage}"] = _fit_losses(engine, steps)
            if cuda and stage == 0:
                inputs_cast_after_written[dtype] = _fresh_input_is_cast_after_written(engine)
            _teardown()
    return {
        "ok": all(_falling(v) for v in runs.values()) and all(inputs_cast_after_written.values()),
        "detail": {
            **{k: (v[0], v[-1]) for k, v in runs.items()},
            "inputs_cast_after_written": inputs_cast_after_written,
        },
    }


def _fresh_input_is_cast_after_written(engine: Any) -> bool:
    """`model(x * 2)` with an fp32 input just queued on the busy compute stream (the forward
    pre-hook casts it to the compute dtype) equals the output for the same input long written: a
    cast on the copy stream without waiting would read the input before it is written."""
    dev = next(engine.module.parameters()).device
    x = torch.randn(4096, 64, device=dev)
    engine.module.eval()
    with torch.no_grad():
        settled = x * 2
        torch.cuda.synchronize()
        reference = engine.model(settled).float()
        torch.full_like(x, float("nan"))  # freed at once: stale NaNs where x * 2 may land
        busy = torch.randn(4096, 4096, device=dev)
        for _ in range(20):
            busy = torch.tanh(busy @ busy)  # the compute stream is busy for a while
        fresh = engine.model(x * 2).float()
    engine.module.train()
    return torch.equal(fresh, reference)


def check_fp16_overflow(cuda: bool, steps: int) -> dict[str, Any]:
    """An infinite loss on one micro-batch: exactly one skipped step, with and without
    accumulation, and the step count, the LR schedule and max_steps agree."""
    if not cuda:
        return {"ok": True, "skipped": True, "detail": "fp16 needs a GPU"}
    detail = {}
    ok = True
    for k_steps in (1, 2):
        calls = [0]

        def step(engine: Any, batch: Any, k: int = k_steps, calls: list[int] = calls) -> torch.Tensor:
            calls[0] += 1
            x, y = batch
            loss = engine.loss(engine.model(x), y)
            # The first micro-batch of step 3 with accumulation (its boundary is call 3k), so the
            # overflow sits in accumulated gradients before the boundary; step 2's without.
            return loss * float("inf") if calls[0] == 3 * k - 1 else loss

        engine = _engine(0, amp="fp16", k_steps=k_steps, train_step=step, scheduler=_linear_decay)
        losses = _fit_losses(engine, 8)
        state, runtime = engine.state, engine.runtime
        scheduler_steps = (
            runtime.deepspeed_engine.lr_scheduler.last_epoch if runtime.deepspeed_engine.lr_scheduler else -1
        )
        detail[f"k_steps={k_steps}"] = {
            "skipped": state.skipped_steps,
            "global_step": state.global_step,
            "scheduler_steps": scheduler_steps,
            "finite_losses": all(math.isfinite(v) for v in losses),
        }
        ok &= (
            state.skipped_steps == 1
            and state.global_step == 8
            and scheduler_steps == 8
            and all(math.isfinite(v) for v in losses)
        )
        _teardown()
    return {"ok": ok, "detail": detail}


def _linear_decay(optimizer: Any, total_steps: int = 1) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / max(total_steps, 1)))


def check_checkpoints(cuda: bool, steps: int) -> dict[str, Any]:
    """Save, resume and export on the device; the rank file loads in a CPU-only process."""
    from framework.checkpoint import store
    from framework.export import fp32_state_dict

    with tempfile.TemporaryDirectory() as tmp:
        first = _engine(2)
        _fit_losses(first, steps, save_dir=tmp)
        weights = {k: v.float().cpu() for k, v in first.runtime.full_state_dict().items()}
        _teardown()
        resumed = _engine(2)
        _fit_losses(resumed, steps + 2, save_dir=tmp, resume="auto")
        continued = resumed.state.global_step == steps + 2 and resumed.state.info.resumed_from is not None
        _teardown()
        exported = fp32_state_dict(store.find_resumable(tmp))
        newest = store.find_resumable(tmp)
        code = (
            "from framework.checkpoint import safety; import sys; "
            "state = safety.load_safely(sys.argv[1]); print(sorted(state))"
        )
        cpu_only = subprocess.run(
            [sys.executable, "-c", code, str(store.rank_file(newest, 0))],
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
    same_keys = set(weights) == set(exported)
    ok = continued and same_keys and cpu_only.returncode == 0
    return {
        "ok": ok,
        "detail": {
            "resumed": continued,
            "export_keys_match": same_keys,
            "cpu_load": cpu_only.stderr[-300:] or "ok",
        },
    }


def check_host_syncs(cuda: bool, steps: int) -> dict[str, Any]:
    """No device-to-host synchronisation in training steps that are not logging points: none that
    torch's sync debugging reports, and no explicit device synchronize (which it does not report)."""
    if not cuda:
        return {"ok": True, "skipped": True, "detail": "sync debugging is CUDA's"}
    import warnings

    from deepspeed.accelerator import get_accelerator

    watching, explicit = [False], []
    accelerator = get_accelerator()
    real_synchronize = accelerator.synchronize

    def counting(*args: Any, **kwargs: Any) -> Any:
        if watching[0]:
            explicit.append(traceback.format_stack(limit=3)[0].strip().splitlines()[0])
        return real_synchronize(*args, **kwargs)

    class Watch:
        def on_event(self, event: Any, state: Any, control: Any = None) -> None:
            if event.value == "step_start":
                watching[0] = state.global_step >= 3
                # After the build's quiet_deepspeed(), whose "ignore" filters for deepspeed.* and
                # torch.distributed.* would hide syncs made in their frames.
                warnings.filterwarnings("always", message=".*synchroniz.*")
                torch.cuda.set_sync_debug_mode("warn" if watching[0] else 0)
            elif event.value == "step_end":
                watching[0] = False
                torch.cuda.set_sync_debug_mode(0)

    accelerator.synchronize = counting  # this object only; DeepSpeed's behaviour is unchanged
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from framework.data.datasets import digits

            _engine(0).fit(
                digits()[0],
                epochs=100,
                batch_size=64,
                max_steps=steps + 3,
                log_freq=10**6,
                progress=False,
                callbacks=[Watch()],
            )
            torch.cuda.set_sync_debug_mode(0)
            # Not torch's one-time notice that sync debugging is a prototype: the syncs it reports.
            found = [str(w.message).splitlines()[0] for w in caught]
            syncs = [m for m in found if "synchroniz" in m and "prototype" not in m]
    finally:
        del accelerator.synchronize
        _teardown()
    detail = {
        "syncs": syncs[:5],
        "count": len(syncs),
        "explicit": explicit[:5],
        "explicit_count": len(explicit),
    }
    return {"ok": not syncs and not explicit, "detail": detail}


def check_memory(cuda: bool, steps: int) -> dict[str, Any]:
    """Peak device memory per ZeRO stage for a ~25 M GPT (one rank), next to Engine.cost()."""
    from framework import Engine, Strategy
    from framework.models import GPT, LMLoss
    from framework.plan.cost import live_tensor_bytes

    size = {"n_layer": 8, "n_embd": 512, "n_head": 8} if cuda else {"n_layer": 2, "n_embd": 64, "n_head": 2}
    rows = {}
    for stage in (0, 1, 2, 3):
        # Earlier stages' engines outlive their teardown (DeepSpeed keeps references): what they
        # hold is measured first and left out of this stage's numbers.
        gc.collect()  # what is only garbage goes now, not during this stage (its peak would shrink)
        earlier = set() if cuda else live_tensor_bytes()[1]
        before = torch.cuda.memory_allocated() if cuda else 0
        torch.manual_seed(0)
        engine = Engine(
            GPT(vocab_size=128, block_size=64, **size), LMLoss(), functools.partial(torch.optim.Adam, lr=1e-4),
            strategy=Strategy(sharding={"stage": stage}),
        )  # fmt: skip
        estimate = engine.cost()["total_bytes"]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        engine.prepare("train", 8)
        ids = torch.randint(0, 128, (8, 65))
        for _ in range(2):
            engine.run((ids[:, :-1], ids[:, 1:]), mode="train")
        measured = torch.cuda.max_memory_allocated() - before if cuda else live_tensor_bytes(earlier)[0]
        rows[f"zero{stage}"] = {"estimate_MB": estimate / 2**20, "measured_MB": measured / 2**20}
        _teardown()
        del engine
    if not cuda:  # no peak counter on the CPU: the rows are what stays alive after the steps
        return {"ok": True, "skipped": True, "detail": rows}
    return {"ok": all(r["measured_MB"] >= 0.9 * r["estimate_MB"] for r in rows.values()), "detail": rows}


def _shell_env() -> dict[str, str]:
    """This process's environment as a user's shell would have it: without what the checks
    before set for their own process groups and accelerator (DS_ACCELERATOR, ranks, ports)."""
    drop = ("DS_ACCELERATOR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in drop}


def check_train_py(cuda: bool, steps: int) -> dict[str, Any]:
    """train.py end to end on the device; trainer.accelerator=cpu trains on the CPU (asked only
    where the default is a GPU: on a CPU machine it is the default's run again)."""
    results = {}
    runs = [("default", [])] + ([("cpu", ["trainer.accelerator=cpu"])] if cuda else [])
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in runs:
            run = subprocess.run(
                [sys.executable, str(ROOT / "train.py"), f"trainer.max_steps={steps}", "trainer.epochs=1", *extra, f"hydra.run.dir={tmp}/{name}"],
                capture_output=True, text=True, cwd=ROOT, env={**_shell_env(), "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
            where = "cuda" if "on cuda" in run.stdout else "cpu" if "on cpu" in run.stdout else "?"
            results[name] = {
                "returncode": run.returncode,
                "device": where,
                "tail": run.stderr[-3000:] if run.returncode else "",
            }
    ok = results["default"]["returncode"] == 0 and results["default"]["device"] == ("cuda" if cuda else "cpu")
    ok &= not cuda or (results["cpu"]["returncode"] == 0 and results["cpu"]["device"] == "cpu")
    return {"ok": ok, "detail": results}


CHECKS: list[tuple[str, Callable[[bool, int], dict[str, Any]]]] = [
    ("placement", check_placement),
    ("zero_stages", check_zero_stages),
    ("mixed_precision", check_mixed_precision),
    ("fp16_overflow", check_fp16_overflow),
    ("checkpoints", check_checkpoints),
    ("host_syncs", check_host_syncs),
    ("overlap", check_overlap),
    ("memory", check_memory),
    ("train_py", check_train_py),
]


def _out_dir(given: Path | None, smoke: bool) -> Path:
    """--out-dir; else a fresh temporary dir for --smoke (a CPU run never replaces the GPU's
    report); else $OUT when set, else benchmarks/results/."""
    if given is not None:
        return given
    if smoke:
        return Path(tempfile.mkdtemp(prefix="gpu_check_smoke_"))
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS


def main(argv: list[str] | None = None) -> int:
    """Run every check; write the report; 0 when all passed."""
    args = parse_args(__doc__, argv)
    quiet()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["DS_ACCELERATOR"] = "cuda" if cuda else "cpu"  # what every check's engine chooses
    steps = 20 if cuda else 6
    out_dir = _out_dir(args.out_dir, args.smoke)
    out_dir.mkdir(parents=True, exist_ok=True)
    checks: list[dict[str, Any]] = []
    for name, check in CHECKS:
        checks.append(_run_check(name, check, cuda, steps))
        # after every check: a run stopped from outside (a time limit) keeps what it found so far
        report = {
            "benchmark": "gpu_check",
            "device": "cuda" if cuda else "cpu",
            "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "machine": machine(),
            "passed": all(c["ok"] for c in checks) and len(checks) == len(CHECKS),
            "checks": checks,
        }
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"{'passed' if report['passed'] else 'FAILED'}: {out_dir / 'gpu_check.json'}")
    return 0 if report["passed"] else 1


def _run_check(
    name: str, check: Callable[[bool, int], dict[str, Any]], cuda: bool, steps: int
) -> dict[str, Any]:
    """One check, timed; a crash is a failed check (the others still run); one line printed."""
    start = time.perf_counter()
    try:
        result = check(cuda, steps)
    except Exception as exc:  # noqa: BLE001 - a check that crashes fails, the others still run
        result = {
            "ok": False,
            "detail": f"{type(exc).__name__}: {exc}",
            "trace": traceback.format_exc()[-2000:],
        }
        _teardown()
    result = {"name": name, "seconds": round(time.perf_counter() - start, 1), **result}
    state = "skipped" if result.get("skipped") else ("ok" if result["ok"] else "FAILED")
    detail = json.dumps(result["detail"], default=str)[:300]
    print(f"{name:16s} {state:8s} {result['seconds']:6.1f} s  {detail}", flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
