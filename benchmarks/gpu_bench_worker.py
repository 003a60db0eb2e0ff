"""Rows of `benchmarks.gpu_bench`, in this process (started by it, one row per process on a GPU,
all rows in one process for --smoke).

    python -m benchmarks.gpu_bench_worker SETUP_JSON ROWS_JSON

Each row trains the same Llama on the same token data with the same DeepSpeed JSON, which comes
from the framework's own config function (`Runtime.deepspeed_config_for`, what `Engine` hands
DeepSpeed): `hydraspeed` (Engine.fit), `deepspeed` (a hand-written loop), `accelerate` (its
DeepSpeed plugin) or `lightning` (its DeepSpeedStrategy; it refuses the CPU, where it trains on
one device without DeepSpeed and the row says so). Prints one line per row: `ROW {json}`.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import os
import sys
import traceback
from typing import Any

import torch

from benchmarks.llm import Clock, Setup, TokenData, count_params, flops_per_token, llama

MARK = "ROW "


def strategy_of(row: dict[str, Any]) -> Any:
    """The row's strategy: its ZeRO stage, optimizer offload, compile; bf16 always."""
    from framework import Strategy

    return Strategy(
        sharding={"stage": row["stage"], "offload_optimizer": row["offload"]},
        amp={"enable": True, "dtype": "bf16"},
        compile=row["compile"],
    )


def digest(config: dict[str, Any]) -> str:
    """A short fingerprint of a DeepSpeed JSON (equal configs, equal fingerprints)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def prepared(row: dict[str, Any], setup: Setup) -> dict[str, Any]:
    """What the raw loop and the peers are handed: the model on the device, the DeepSpeed JSON and
    the optimizer the framework would use (DeepSpeed's CPU Adam under offload when it builds)."""
    from framework.backend.placement import offload_optimizer
    from framework.backend.runtime import Runtime

    runtime = Runtime(strategy_of(row))  # on a CPU: offload dropped, as for Engine
    job = runtime.start()
    runtime.fix_layout(setup.micro_batch)
    model = llama(setup, job.device)
    config = runtime.deepspeed_config_for(model)
    factory = offload_optimizer(runtime.strategy, functools.partial(torch.optim.AdamW, lr=setup.lr), job)
    return {
        "model": model,
        "config": config,
        "optimizer": factory(model.parameters()),
        "flops_per_token": flops_per_token(model, setup.seq),
        "params": count_params(model),
        "device": job.device,
        "describe": runtime.strategy.describe(),
    }


def measured(clock: Clock, p: dict[str, Any]) -> dict[str, Any]:
    """The clock's figures for a prepared row, with the model's size."""
    return {**clock.result(p["flops_per_token"]), "params": p["params"]}


def loader(setup: Setup, vocab_size: int, cuda: bool) -> torch.utils.data.DataLoader:
    """The token data in micro-batches, pinned for asynchronous copies on a GPU."""
    data = TokenData(setup, vocab_size)
    return torch.utils.data.DataLoader(data, batch_size=setup.micro_batch, shuffle=True, pin_memory=cuda)


def run_hydraspeed(row: dict[str, Any], setup: Setup) -> dict[str, Any]:
    """Engine.fit, the framework's API, with log_freq past the run (no logging point inside)."""
    from benchmarks.common import start_job
    from framework import Callback, Engine

    job = start_job()
    model = llama(setup, job.device)
    fpt, params = flops_per_token(model, setup.seq), count_params(model)
    clock = Clock(setup)

    class Tick(Callback):
        step = 0

        def on_step_end(self, state: Any) -> None:
            if state.global_step != self.step:
                self.step = state.global_step
                clock.step()

    optimizer = functools.partial(torch.optim.AdamW, lr=setup.lr)
    engine = Engine(model, "model", optimizer, strategy=strategy_of(row), callbacks=[Tick()], process=job)
    data = TokenData(setup, model.config.vocab_size)
    engine.fit(data, batch_size=setup.micro_batch, max_steps=setup.run_steps, log_freq=10**9, progress=False)
    config = engine.runtime.config
    ran = engine.runtime.strategy.describe()
    return {**clock.result(fpt), "params": params, "config": digest(config), "ran": ran}


def run_deepspeed(row: dict[str, Any], setup: Setup) -> dict[str, Any]:
    """A minimal hand-written DeepSpeed loop with the identical JSON, model and optimizer."""
    import deepspeed

    p = prepared(row, setup)
    model, cuda = p["model"], p["device"].type == "cuda"
    if row["compile"]:
        model.compile()  # what strategy.compile does before deepspeed.initialize
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=p["optimizer"], config=p["config"])
    clock = Clock(setup)
    for batch in loader(setup, model.config.vocab_size, cuda):
        batch = {k: v.to(p["device"], non_blocking=True) for k, v in batch.items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        clock.step()
        if clock.count == setup.run_steps:
            break
    return {**measured(clock, p), "config": digest(p["config"]), "ran": p["describe"]}


def run_accelerate(row: dict[str, Any], setup: Setup) -> dict[str, Any]:
    """HF Accelerate with its DeepSpeed plugin given the identical JSON."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    p = prepared(row, setup)
    config_digest = digest(p["config"])  # Accelerate fills in keys of the dict it is given
    accelerator = Accelerator(
        mixed_precision="bf16", deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=p["config"])
    )
    data = loader(setup, p["model"].config.vocab_size, p["device"].type == "cuda")
    model, optimizer, data = accelerator.prepare(p["model"], p["optimizer"], data)
    clock = Clock(setup)
    for batch in data:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        clock.step()
        if clock.count == setup.run_steps:
            break
    ran = f"{accelerator.distributed_type.value} {p['describe']}"
    return {**measured(clock, p), "config": config_digest, "ran": ran}


def run_lightning(row: dict[str, Any], setup: Setup) -> dict[str, Any]:
    """Lightning's DeepSpeedStrategy given the identical JSON (CUDA only: on a CPU, one device
    with bf16-mixed and no DeepSpeed, which the row's `ran` says)."""
    import lightning as L

    p = prepared(row, setup)
    cuda = p["device"].type == "cuda"
    config_digest = digest(p["config"])
    clock = Clock(setup)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = p["model"]

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> Any:
            return p["optimizer"]

    class Tick(L.Callback):
        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            clock.step()

    if cuda:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        # Lightning refuses the key and sets it from Trainer(accumulate_grad_batches=1): the same value.
        config = {k: v for k, v in p["config"].items() if k != "gradient_accumulation_steps"}
        strategy: Any = DeepSpeedStrategy(config=config)
        ran = f"DeepSpeedStrategy {p['describe']}"
    else:
        strategy, ran = "auto", "single device, bf16-mixed, no DeepSpeed (its DeepSpeedStrategy needs CUDA)"
    trainer = L.Trainer(
        accelerator="cuda" if cuda else "cpu", devices=1, strategy=strategy, precision="bf16-mixed",
        max_steps=setup.run_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Tick()],
    )  # fmt: skip
    trainer.fit(Module(), loader(setup, p["model"].config.vocab_size, cuda))
    return {**measured(clock, p), "config": config_digest, "ran": ran}


RUNNERS = {
    "hydraspeed": run_hydraspeed,
    "deepspeed": run_deepspeed,
    "accelerate": run_accelerate,
    "lightning": run_lightning,
}


def run_row(row: dict[str, Any], setup: Setup) -> dict[str, Any]:
    """One row: its measurements, or why it has none (a missing package, an error)."""
    from benchmarks.common import end_job

    try:
        result = {"status": "ok", **RUNNERS[row["framework"]](row, setup)}
    except ImportError as exc:
        result = {"status": f"missing: {exc}"}
    except Exception as exc:  # noqa: BLE001 - one failing row is reported, the others still run
        message = (str(exc).strip().splitlines() or [""])[0][:300]
        result = {
            "status": f"failed: {type(exc).__name__}: {message}",
            "trace": traceback.format_exc()[-1500:],
        }
    if row["compile"]:  # --smoke turns torch.compile off (TORCH_COMPILE_DISABLE) to stay fast
        result["compiled"] = os.environ.get("TORCH_COMPILE_DISABLE", "0") in ("", "0")
    end_job()
    gc.collect()
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name(0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {**row, **result}


def main(argv: list[str]) -> None:
    """Run the rows given on the command line, one JSON line each."""
    from benchmarks.common import quiet

    quiet()
    setup = Setup(**json.loads(argv[0]))
    for row in json.loads(argv[1]):
        print(MARK + json.dumps(run_row(row, setup), default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
