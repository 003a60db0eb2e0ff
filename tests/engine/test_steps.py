"""Step flavours: iterator-consuming steps, what the framework counts, and the pipeline engine."""

from __future__ import annotations

import functools
import json
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

from framework import Callback, ConfigError, Engine, Strategy
from framework.engine import epoch
from framework.models import MLP

from ..conftest import FAST, ROOT, fails_cleanly, final_metrics, run_cmd, run_train


def dataset(n_batches: int, batch: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n_batches * batch, 64, generator=g),
        torch.randint(0, 10, (n_batches * batch,), generator=g),
    )


class Recorder(Callback):
    """Per step call: (optimizer steps so far, batches fetched this epoch, on-device check)."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []
        self.starts: list[tuple[int, int]] = []

    def on_step_start(self, state):
        self.starts.append((state.global_step, state.batches_in_epoch))

    def on_step_end(self, state):
        self.calls.append((state.global_step, state.batches_in_epoch))


def engine_with(step, k_steps: int = 1, stage: int = 0, **kwargs) -> Engine:
    torch.manual_seed(0)
    strategy = Strategy(sharding={"stage": stage}, gradient_merge={"k_steps": k_steps})
    return Engine(
        MLP(hidden=[16]),
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        strategy=strategy,
        train_step=step,
        **kwargs,
    )


def two_batch_step(engine, dataloader_iter):
    (x1, y1), (x2, y2) = next(dataloader_iter), next(dataloader_iter)
    assert x1.device == engine.process.device  # batches arrive on the device
    return (engine.loss(engine.model(x1), y1) + engine.loss(engine.model(x2), y2)) / 2


def test_two_batch_step_counts_calls_batches_and_steps():
    rec = Recorder()
    engine = engine_with(two_batch_step, callbacks=[rec])
    engine.fit(dataset(20), epochs=1, batch_size=8)
    st = engine.state
    assert (st.step_calls, st.batches_fetched, st.global_step, st.samples_seen) == (10, 20, 10, 160)
    assert rec.calls == [(i, 2 * i) for i in range(1, 11)]  # progress sees every fetched batch
    # each call starts where the last ended; no 11th call: the epoch is known to be over
    assert rec.starts == [(i, 2 * i) for i in range(0, 10)]


def test_a_step_is_never_called_on_an_exhausted_epoch():
    """A 3-batch step over 20 batches: 7 calls, the last pulling the 2 that are left."""
    pulls = []

    def three_batch_step(engine, dataloader_iter):
        got = []
        try:
            for _ in range(3):
                got.append(next(dataloader_iter))
        finally:
            pulls.append(len(got))
        return sum(engine.loss(engine.model(x), y) for x, y in got) / 3

    engine_with(three_batch_step).fit(dataset(20), epochs=1, batch_size=8)
    assert pulls == [3, 3, 3, 3, 3, 3, 2]


def test_max_steps_counts_optimizer_steps_for_an_iterator_step():
    engine = engine_with(two_batch_step)
    engine.fit(dataset(20), epochs=3, batch_size=8, max_steps=7)
    assert (engine.state.global_step, engine.state.batches_fetched) == (7, 14)
    assert engine.state.stop_reason == "reached trainer.max_steps=7"


def test_iterator_step_with_accumulation_steps_at_the_boundaries():
    rec = Recorder()
    engine = engine_with(two_batch_step, k_steps=2, callbacks=[rec])
    engine.fit(
        dataset(16, batch=4), epochs=1, batch_size=8
    )  # micro-batch 4, 2 micro-steps per optimizer step
    assert [steps for steps, _ in rec.calls] == [0, 1, 1, 2, 2, 3, 3, 4]
    assert engine.state.batches_fetched == 16


def test_stop_iteration_inside_a_step_ends_the_epoch_cleanly():
    def three_batch_step(engine, dataloader_iter):
        batches = [next(dataloader_iter) for _ in range(3)]
        return sum(engine.loss(engine.model(x), y) for x, y in batches) / 3

    engine = engine_with(three_batch_step)
    history = engine.fit(dataset(10), epochs=2, batch_size=8)
    st = engine.state
    assert st.step_calls == 3 and st.global_step == 6  # 3 full calls per epoch, the 4th ran out
    assert st.batches_fetched == 20 and len(history["loss"]) == 2


def test_calls_that_pull_no_batch_are_fine_and_cannot_loop_forever(monkeypatch):
    def every_third_call(engine, dataloader_iter, _count=[0]):  # noqa: B006 - a call counter
        _count[0] += 1
        if _count[0] % 3:
            return None
        x, y = next(dataloader_iter)
        return engine.loss(engine.model(x), y)

    engine = engine_with(every_third_call)
    engine.fit(dataset(5), epochs=1, batch_size=8)
    assert engine.state.batches_fetched == 5 and engine.state.global_step == 5

    monkeypatch.setattr(epoch, "MAX_IDLE_CALLS", 50)
    with pytest.raises(RuntimeError, match="pulled no batch in 50 consecutive calls"):
        engine_with(lambda engine, dataloader_iter: None).fit(dataset(5), epochs=1, batch_size=8)


def test_manual_step_returns_metrics_and_drives_the_optimizer():
    def manual(engine, dataloader_iter):
        for _ in range(2):
            x, y = next(dataloader_iter)
            engine.backward(engine.loss(engine.model(x), y) / 2)
        engine.step()
        return {"loss": 1.5}

    engine = engine_with(manual)
    history = engine.fit(dataset(8), epochs=1, batch_size=8)
    assert engine.state.global_step == 4 and history["loss"] == [1.5]


def test_a_step_that_skips_every_batch_is_named_as_the_cause_not_the_data():
    """A step returning None skips its batch (Lightning's way): one that skipped all 5 failed with
    "the training data ran out before one global batch", which was false. A step that drives the
    optimizer itself and returns None has skipped nothing."""
    with pytest.raises(ConfigError) as error:
        engine_with(lambda engine, batch: None).fit(dataset(5), epochs=1, batch_size=8, progress=False)
    assert str(error.value).startswith("no optimizer step was trained: the training step skipped the 5 batch")
    assert "ran out" not in str(error.value) and "returned None" in str(error.value)

    def manual(engine, batch):
        engine.backward(engine.loss(engine.model(batch[0]), batch[1]))
        engine.step()

    driven = engine_with(manual)
    driven.fit(dataset(4), epochs=1, batch_size=8, progress=False)
    assert driven.state.global_step == 4 and driven.state.skipped_batches == 0


def test_batches_a_step_skips_are_said_once_and_never_logged_as_a_zero_loss(capsys):
    """Epoch 1 skips every other batch, epoch 2 every batch: one warning line, a loss for epoch 1
    only (an epoch whose batches were all skipped logs none, never 0.0)."""

    def skipping(engine, batch):
        engine.calls = getattr(engine, "calls", 0) + 1
        if engine.state.epoch == 1 or engine.calls % 2 == 0:
            return None
        return engine.loss(engine.model(batch[0]), batch[1])

    run = engine_with(skipping)
    history = run.fit(dataset(6), epochs=2, batch_size=8, progress=False)
    assert run.state.global_step == 3 and run.state.skipped_batches == 3 + 6
    assert len(history["loss"]) == 1 and history["loss"][0] > 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "skipped" in line]
    assert lines == [
        "warning: the training step skipped 3 of the 6 batches of epoch 1 (it returned None): nothing was "
        "trained on them, and the logged loss leaves them out"
    ]


def test_model_methods_are_steps_too():
    class Model(MLP):
        def training_step(self, dataloader_iter):
            x, y = next(dataloader_iter)
            return torch.nn.functional.cross_entropy(self(x), y)

        def validation_step(self, dataloader_iter):
            x, y = next(dataloader_iter)
            return {"loss": float(torch.nn.functional.cross_entropy(self(x), y))}

    engine = Engine(Model(hidden=[16]), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    history = engine.fit(dataset(8), valid_data=dataset(4), epochs=1, batch_size=8)
    assert engine.state.batches_fetched == 8 and history["val_loss"][0] > 0


@pytest.mark.slow
@pytest.mark.parametrize("flavour, expect", [("two_batch", (11, 22, 44)), ("tbptt", (None, 20, 80))])
def test_iterator_step_example(tmp_path, flavour, expect):
    out = tmp_path / "result.json"
    extra = ["--max-steps", "20"] if flavour == "tbptt" else []
    run = run_cmd(
        [sys.executable, str(ROOT / "examples" / "iterator_step.py"), flavour, "--out", str(out), *extra]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    calls, steps, fetched = expect
    assert (result["optimizer_steps"], result["batches_fetched"]) == (steps, fetched)
    if calls is not None:
        assert result["step_calls"] == calls
    assert result["loss"][-1] < result["loss"][0] or flavour == "tbptt" and result["loss"][0] < 4.0


@pytest.mark.slow
def test_iterator_step_from_config_counts_fetched_batches(tmp_path):
    step = "step={_target_:examples.iterator_step.two_batch_step,_partial_:true}"
    run = run_train([step, *FAST, "trainer.log_freq=2"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["batches"] for r in steps[:3]] == [4, 8, 12]  # 2 batches per optimizer step
    assert final_metrics(tmp_path)["batches"] == 22 and final_metrics(tmp_path)["step"] == 11


@pytest.mark.slow
def test_eval_step_from_config_replaces_the_default_validation(tmp_path):
    step = "eval_step={_target_:examples.iterator_step.two_batch_eval_step,_partial_:true}"
    run = run_train([step, *FAST], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    final = final_metrics(tmp_path)
    assert 0 < final["val_loss"] < 2.0  # what the custom step returned, averaged
    assert "val_accuracy" not in final  # the default step (which updates the metrics) did not run


# ---------------------------------------------------------------- pipeline


@pytest.mark.slow
def test_gpt_pipeline_learns_and_matches_the_unpipelined_run(tmp_path):
    """2 pipeline stages: validation loss falls >= 1 nat; the curve equals ZeRO-3 without a pipeline."""
    common = [
        "experiment=gpt_pipeline",
        "trainer.max_steps=30",
        "trainer.log_freq=5",
        "trainer.steps_per_epoch=30",
    ]
    pipe = run_train(common, tmp_path / "pipe", timeout=300)  # the experiment asks for trainer.devices=2
    assert pipe.returncode == 0, pipe.stderr[-3000:]
    flat = run_train(
        [*common, "strategy=zero3", "trainer.valid_at_start=false"], tmp_path / "flat", timeout=300
    )
    assert flat.returncode == 0, flat.stderr[-3000:]
    final = final_metrics(tmp_path / "pipe")
    assert final["start_val_loss"] - final["val_loss"] >= 1.0
    assert final["batches"] == 30 * 4  # 4 micro-batches per optimizer step, counted

    def losses(run_dir):
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "step"]

    # Same weights, data and updates; only the float summation order differs. Adam amplifies it:
    # from step ~16 a 1e-4 difference can grow into a loss spike on one side (seen at lr 3e-3),
    # so the curves are compared over the first three logged windows (steps 1-15).
    assert losses(tmp_path / "pipe")[:3] == pytest.approx(losses(tmp_path / "flat")[:3], rel=1e-2)
    assert final["val_loss"] == pytest.approx(final_metrics(tmp_path / "flat")["val_loss"], rel=1e-2)


@pytest.mark.slow
def test_pipeline_with_zero3_is_a_clear_error(tmp_path):
    run = run_train(["experiment=gpt_pipeline", "strategy.sharding.stage=3"], tmp_path)
    fails_cleanly(run, "cannot run with ZeRO stage 3", "0 and 1")


@pytest.mark.slow
def test_pipeline_stages_must_divide_processes(tmp_path):
    fails_cleanly(
        run_train(["experiment=gpt_pipeline", "trainer.devices=1"], tmp_path),
        "stages=2 does not divide the 1 processes",
    )


@pytest.mark.slow
def test_unknown_pipeline_schedule(tmp_path):
    run = run_train(["experiment=gpt_pipeline", "strategy.pipeline.schedule=gpipe"], tmp_path)
    fails_cleanly(run, "schedule='gpipe' is not supported", "1F1B")


@pytest.mark.slow
def test_model_that_cannot_be_split(tmp_path):
    run = run_train(["strategy=pipeline", "model=cnn", "trainer.devices=2", *FAST], tmp_path)
    fails_cleanly(run, "CNN cannot be split into pipeline stages", "pipeline_layers()")


def test_custom_step_with_pipeline_is_refused():
    with pytest.raises(
        ConfigError, match="custom training/validation steps cannot run with pipeline parallelism"
    ):
        Engine(
            MLP(),
            torch.nn.CrossEntropyLoss(),
            strategy=Strategy(pipeline={"stages": 2}),
            train_step=two_batch_step,
        )
