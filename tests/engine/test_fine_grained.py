"""The Paddle-style fine-grained API: dataloader -> prepare -> run, DistModel / to_static, shard_dataloader."""

from __future__ import annotations

import copy
import functools
import json
import sys

import pytest
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

from framework import ConfigError, DistModel, Engine, Strategy, shard_dataloader, to_static
from framework.data.datasets import digits, synthetic
from framework.models import MLP
from framework.plan.cost import live_tensor_bytes

from ..conftest import ROOT, end_group, run_cmd, torchrun


def accuracy():
    return torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")


def make_engine(stage=0, loss=True, optimizer=True, **kwargs):
    torch.manual_seed(0)
    return Engine(
        MLP(hidden=[32]),
        torch.nn.CrossEntropyLoss() if loss else None,
        functools.partial(torch.optim.AdamW, lr=1e-2) if optimizer else None,
        accuracy(),
        **{"strategy": Strategy(sharding={"stage": stage}), **kwargs},
    )


# ---------------------------------------------------------------- examples, 1 and 2 processes


def _run_example(name, tmp_path, nproc, stage):
    out = tmp_path / f"{name}-{nproc}.json"
    launcher = torchrun(nproc) if nproc > 1 else [sys.executable]
    run = run_cmd(
        [*launcher, str(ROOT / "examples" / f"{name}.py"), "--stage", str(stage), "--out", str(out)]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def fit_accuracy():
    """Engine.fit with the examples' settings (5 epochs, global batch 64, AdamW 3e-3, no schedule)."""
    torch.manual_seed(0)
    train, valid = digits()
    engine = Engine(
        MLP(), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=3e-3), accuracy()
    )
    history = engine.fit(train, valid, epochs=5, batch_size=64)
    engine.close()  # a module fixture: set up before the per-test fixture that restores the environment
    return history["val_accuracy"][-1]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fine_grained", "dist_model"])
@pytest.mark.parametrize("nproc, stage", [(1, 0), (2, 3)])
def test_examples_match_fit(tmp_path, fit_accuracy, name, nproc, stage):
    result = _run_example(name, tmp_path, nproc, stage)
    assert result["val_accuracy"] > 0.9
    assert result["val_accuracy"] == pytest.approx(fit_accuracy, abs=0.02)


# ---------------------------------------------------------------- run() semantics


def test_run_logs_loss_metrics_and_fetches():
    engine = make_engine()
    train = synthetic(num_samples=256).train
    loader = engine.dataloader(train, batch_size=32, shuffle=True, mode="train")
    engine.prepare(mode="train")
    batch = next(iter(loader))
    reference = copy.deepcopy(engine.module)  # the same weights in plain torch: the expected gradient norm
    torch.nn.functional.cross_entropy(reference(batch[0]), batch[1]).backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item()
    logs = engine.run(batch, mode="train", fetch_list=["features.0", "lr", "grad_norm", "loss_scale"])
    assert set(logs) == {"loss", "accuracy", "fetches"}
    assert isinstance(logs["loss"], float)
    assert logs["fetches"]["features.0"].shape == (32, 32)  # the first Linear's output for the batch
    assert logs["fetches"]["lr"] == pytest.approx(1e-2)
    assert logs["fetches"]["grad_norm"] == pytest.approx(expected, rel=1e-5)
    assert logs["fetches"]["loss_scale"] == 1.0


def test_run_splits_a_batch_into_accumulation_steps_and_steps_once():
    engine = make_engine(strategy=Strategy(gradient_merge={"k_steps": 4}))
    loader = engine.dataloader(synthetic(num_samples=256).train, batch_size=32, mode="train")
    batch = next(iter(loader))
    assert len(batch[0]) == 32  # the global batch on one rank; run() makes 4 micro-batches of 8
    engine.run(batch, mode="train")
    assert engine.runtime.global_steps == 1 and engine.runtime.micro_steps == 4


def test_metrics_accumulate_across_runs_until_reset():
    engine = make_engine()
    valid = synthetic(num_samples=200).valid
    loader = engine.dataloader(valid, batch_size=8, mode="eval")
    batches = list(loader)
    first = engine.run(batches[0], mode="eval")["accuracy"]
    engine.run(batches[1], mode="eval")
    assert engine.metrics.eval["accuracy"].update_count == 2
    engine.reset_metrics()
    assert engine.run(batches[0], mode="eval")["accuracy"] == pytest.approx(first)
    assert engine.metrics.eval["accuracy"].update_count == 1


def test_eval_mode_changes_no_parameter():
    engine = make_engine()
    loader = engine.dataloader(synthetic(num_samples=200).valid, batch_size=8, mode="eval")
    before = [p.detach().clone() for p in engine.module.parameters()]
    for batch in loader:
        engine.run(batch, mode="eval")
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


def test_prepare_twice_is_a_no_op():
    engine = make_engine()
    engine.prepare("train", batch_size=8)
    ds_engine = engine.runtime.deepspeed_engine
    engine.prepare("train", batch_size=8)
    engine.prepare("eval")
    assert engine.runtime.deepspeed_engine is ds_engine


def test_dataloader_from_generator():
    engine = make_engine()
    data = synthetic(num_samples=100).train

    def samples():
        return (data[i] for i in range(len(data)))

    loader = engine.dataloader_from_generator(samples, batch_size=16, epochs=2, mode="train")
    batches = list(loader)
    assert len(batches) == 2 * (len(data) // 16) and batches[0][0].shape == (16, 64)
    logs = engine.run(batches[0])
    assert logs["loss"] > 0


@pytest.mark.slow
def test_cost_matches_measured_model_state_bytes():
    """Engine.cost() against the tensor bytes really alive after a backward (states, grads, params)."""
    for stage in (0, 1, 2, 3):
        _, base = live_tensor_bytes()
        torch.manual_seed(0)
        engine = Engine(
            MLP(in_features=256, hidden=[512, 512]),
            torch.nn.CrossEntropyLoss(),
            functools.partial(torch.optim.Adam, lr=1e-3),
            strategy=Strategy(sharding={"stage": stage}),
        )
        estimate = engine.cost()
        engine.prepare("train", batch_size=16)
        x, y = torch.randn(16, 256), torch.randint(0, 10, (16,))
        engine.backward(engine.loss(engine.model(x), y))
        engine.step()  # optimizer states now exist
        # a boundary backward, as fit() and run() do: gradients held (reduced at ZeRO >= 1), before the step
        engine.runtime.deepspeed_engine.backward(engine.loss(engine.model(x), y))
        measured, _ = live_tensor_bytes(exclude=base)
        assert measured == pytest.approx(estimate["total_bytes"], rel=0.10), stage
        engine.runtime.deepspeed_engine.step()
        del engine
        end_group()


# ---------------------------------------------------------------- errors


def test_run_before_prepare_says_what_to_call():
    engine = make_engine()
    with pytest.raises(
        ConfigError, match=r"call engine.prepare\(mode=...\) or engine.dataloader\(..., mode=...\) first"
    ):
        engine.run((torch.zeros(2, 64), torch.zeros(2, dtype=torch.long)), mode="train")


def test_unknown_mode_lists_modes():
    engine = make_engine()
    with pytest.raises(ValueError, match="'train', 'eval', 'predict'"):
        engine.dataloader(synthetic().train, batch_size=8, mode="test")
    engine.prepare("eval")
    with pytest.raises(ValueError, match="'train', 'eval', 'predict'"):
        engine.run(torch.zeros(2, 64), mode="infer")


def test_missing_loss_or_optimizer_errors():
    with pytest.raises(ConfigError, match="set optimizer and loss before training"):
        make_engine(optimizer=False).prepare("train")
    with pytest.raises(ConfigError, match="set optimizer and loss before training"):
        make_engine(loss=False).prepare("train")
    with pytest.raises(ConfigError, match="set loss before evaluation"):
        make_engine(loss=False).prepare("eval")
    with pytest.raises(ConfigError, match="set optimizer and loss before training"):
        to_static(MLP(), loss=torch.nn.CrossEntropyLoss()).train()


def test_fetch_list_typo_names_closest_modules():
    engine = make_engine()
    engine.prepare("predict", batch_size=2)
    with pytest.raises(ValueError, match="'feature.0' is not a sub-module of MLP; closest: features.0"):
        engine.run(torch.zeros(2, 64), fetch_list=["feature.0"])


def test_dist_model_without_a_mode_says_so():
    dm = DistModel(MLP(), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(ConfigError, match=r"call dm.train\(\), dm.eval\(\) or dm.predict\(\)"):
        dm(torch.zeros(2, 64))


# ---------------------------------------------------------------- DistModel / to_static


def test_to_static_default_modes_follow_paddle():
    assert (
        to_static(MLP(), None, torch.nn.CrossEntropyLoss(), torch.optim.SGD(MLP().parameters(), lr=0.1))._mode
        == "train"
    )
    end_group()
    assert to_static(MLP(), None, torch.nn.CrossEntropyLoss())._mode == "eval"
    end_group()
    assert to_static(MLP())._mode == "predict"


def test_to_static_does_not_touch_the_users_loader():
    data = TensorDataset(torch.randn(64, 64), torch.randint(0, 10, (64,)))
    expected = next(
        iter(DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1)))
    )
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    to_static(MLP(), loader, torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1))
    first = next(iter(loader))
    assert torch.equal(first[0], expected[0]) and torch.equal(first[1], expected[1])


@pytest.mark.parametrize("stage", [0, 3])
def test_dist_model_modes_and_state_dict_round_trip(stage):
    torch.manual_seed(0)
    data = synthetic(num_samples=128).train
    loader = shard_dataloader(DataLoader(data, batch_size=16, shuffle=True))
    dm = to_static(
        MLP(hidden=[32]),
        loader,
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.AdamW, lr=1e-2),
        Strategy(sharding={"stage": stage}),
    )
    losses = [float(dm(x, y)) for x, y in loader]
    assert losses[-1] < losses[0]
    x, y = next(iter(loader))
    saved = dm.state_dict(mode="all")
    assert set(saved) == {"model", "optimizer"} and saved["model"]["features.0.weight"].shape == (32, 64)
    dm.predict()
    expected = dm(x).clone()
    dm.train()
    for xb, yb in loader:  # move the weights away
        dm(xb, yb)
    dm.predict()
    assert not torch.allclose(dm(x), expected)
    dm.set_state_dict(saved)
    torch.testing.assert_close(dm(x), expected)
    assert set(dm.state_dict("param")) == set(saved["model"])
    dm.eval()
    assert float(dm(x, y)) > 0


def test_shard_dataloader_keeps_order_of_a_sequential_loader():
    data = TensorDataset(torch.arange(40).float().unsqueeze(1), torch.arange(40))
    sharded = shard_dataloader(DataLoader(data, batch_size=8))
    labels = torch.cat([y for _, y in sharded])
    assert labels.tolist() == list(range(40))
    with pytest.raises(TypeError, match="needs a torch DataLoader"):
        shard_dataloader([data[0]])


def test_run_in_predict_mode_uses_the_predict_step():
    def probabilities(engine, batch):
        return engine.model(batch[0]).softmax(-1)

    engine = make_engine(predict_step=probabilities)
    engine.prepare(mode="predict")
    x = torch.randn(8, 64)
    out = engine.run((x, torch.zeros(8, dtype=torch.long)), mode="predict")["outputs"]
    with torch.no_grad():
        torch.testing.assert_close(out, engine.module(x).softmax(-1))


def test_eval_metrics_are_not_mixed_with_training_metrics():
    """Six epochs of run(mode="train"), then run(mode="eval") over the validation set: the
    accuracy it reports is the accuracy of these weights on the validation set alone."""
    torch.manual_seed(0)
    train, valid = digits()
    engine = Engine(
        MLP(), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=3e-3), accuracy()
    )
    for batch in engine.dataloader(train, batch_size=64, shuffle=True, epochs=6, mode="train"):
        engine.run(batch, mode="train")
    logs = [engine.run(batch, mode="eval") for batch in engine.dataloader(valid, batch_size=64, mode="eval")]
    x = torch.stack([valid[i][0] for i in range(len(valid))])
    y = torch.stack([valid[i][1] for i in range(len(valid))])
    with torch.no_grad():
        expected = float((engine.module(x).argmax(1) == y).float().mean())
    assert logs[-1]["accuracy"] == pytest.approx(expected, abs=1e-6)
    # the next pass over the validation loader starts afresh: the same value again
    again = [engine.run(batch, mode="eval") for batch in engine.dataloader(valid, batch_size=64, mode="eval")]
    assert again[-1]["accuracy"] == pytest.approx(expected, abs=1e-6)
