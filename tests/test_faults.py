"""Faults and bad inputs that used to pass silently, leak disk or end in a traceback: each one is
refused or named in one line. In-process where the behaviour allows it; the CLI cases share
subprocesses, and every wait on another process has its own bound."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from torch.utils.data import TensorDataset

from framework import CheckpointError, ConfigError, Engine, NonFiniteLoss, Strategy, device
from framework.checkpoint import store
from framework.datasets import csv_classification, synthetic
from framework.models import MLP

pytestmark = pytest.mark.timeout(300)

DATA = synthetic(num_samples=512)


@pytest.fixture(autouse=True)
def _fresh_group():
    yield
    device.destroy_process_group()


def engine(stage: int = 0) -> Engine:
    torch.manual_seed(0)
    return Engine(
        MLP(hidden=[32]),
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.AdamW, lr=1e-2),
        strategy=Strategy(sharding={"stage": stage}),
    )


def trained(ckpts, stage: int = 0, save_freq: int = 0):
    engine(stage).fit(DATA.train, epochs=1, batch_size=32, save_dir=str(ckpts), save_freq=save_freq)
    device.destroy_process_group()
    return ckpts


# ------------------------------------------------------------------------------------- silent


def test_a_nan_in_the_validation_data_is_an_error_naming_the_first_bad_batch():
    x = torch.stack([DATA.valid[i][0] for i in range(len(DATA.valid))])
    y = torch.stack([DATA.valid[i][1] for i in range(len(DATA.valid))])
    x[70, 3] = float("nan")  # batch 2 of 32
    with pytest.raises(
        NonFiniteLoss, match="first batch with a non-finite loss is validation batch 2 of rank 0"
    ):
        engine().fit(DATA.train, TensorDataset(x, y), epochs=1, batch_size=32)


def test_a_non_finite_csv_cell_is_named_before_training(tmp_path):
    file = tmp_path / "table.csv"
    file.write_text("a,b,label\n1,2,0\n3,nan,1\n4,5,1\n")
    with pytest.raises(ConfigError, match=r"table.csv, row 3, column 'b': 'nan' is not a finite number"):
        csv_classification(str(file))
    file.write_text("a,b,label\n1,2,0\n-inf,4,1\n")
    with pytest.raises(ConfigError, match=r"row 3, column 'a': '-inf' is not a finite number"):
        csv_classification(str(file))


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            ["trainer.monitor=nosuchmetric"],
            "trainer.monitor=nosuchmetric: this run logs no such value; choose one of loss, lr, accuracy, val_loss, val_accuracy",
        ),
        (
            ["callbacks=early_stopping", "callbacks.early_stopping.monitor=val_acc"],
            "callbacks.early_stopping.monitor=val_acc: this run logs no such value",
        ),
    ],
)
def test_a_monitor_that_names_nothing_the_run_logs_is_refused(compose, overrides, words):
    from framework.build import check_monitors

    cfg = compose(overrides)
    with pytest.raises(ConfigError, match=words):
        check_monitors(cfg, has_valid=True)
    check_monitors(compose(["trainer.monitor=val_accuracy"]), has_valid=True)
    with pytest.raises(ConfigError, match="no validation data, so no val_"):
        check_monitors(compose([]), has_valid=False)


def test_metadata_without_checksums_is_refused(tmp_path):
    path = store.find_resumable(trained(tmp_path))
    meta = json.loads((path / store.COMPLETE).read_text())
    del meta["files"]
    (path / store.COMPLETE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="records no checksums"):
        store.verify(path)
    assert store.find_resumable(tmp_path) is None


def test_an_empty_complete_json_is_named_and_auto_resume_falls_back_past_it(tmp_path, capfd):
    ckpts = trained(tmp_path, save_freq=5)  # 13 steps: 5, 10, 13
    newest = store.find_resumable(ckpts)
    (newest / store.COMPLETE).write_text("{}")
    with pytest.raises(CheckpointError, match=r"COMPLETE.json lacks step, world_size, dp_size"):
        engine().fit(DATA.train, epochs=1, batch_size=32, resume=str(newest))
    device.destroy_process_group()
    resumed = engine()
    resumed.fit(DATA.train, epochs=1, batch_size=32, save_dir=str(ckpts), resume="auto")
    assert resumed.state.info.resumed_from == str(ckpts / store.tag_for(10))
    assert f"skipping checkpoint {newest} is damaged" in capfd.readouterr().err


def test_a_step_dir_that_is_a_symbolic_link_is_refused(tmp_path):
    ckpts = trained(tmp_path / "ckpts")
    real = store.find_resumable(ckpts)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(real, elsewhere)
    link = ckpts / store.tag_for(99)
    link.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CheckpointError, match=f"checkpoint {link} is a symbolic link"):
        store.verify(link)
    assert store.find_resumable(ckpts) == real


# ------------------------------------------------------------------------------------- disk


def test_conversions_are_pruned_with_their_checkpoint_and_interrupted_ones_removed(tmp_path):
    ckpts = trained(tmp_path, stage=2, save_freq=5)  # 5, 10, 13
    first = ckpts / store.tag_for(5)
    converted = store.to_universal(first)
    assert converted.name == "step_00000005_universal" and converted.is_dir()
    store.prune(ckpts, keep_last_k=3)
    assert converted.is_dir()  # its checkpoint is still kept
    store.prune(ckpts, keep_last_k=2)
    assert not first.exists() and not converted.exists()
    # a conversion killed half-way (its process gone) is removed at the next start
    dead = ckpts / f"step_00000010_universal{store.CONVERTING}999999999-abc"
    alive = ckpts / f"step_00000010_universal{store.CONVERTING}{__import__('os').getpid()}-abc"
    for d in (dead, alive):
        (d / "zero").mkdir(parents=True)
        (d / "zero" / "x.pt").write_bytes(b"0" * 1000)
    engine(2).fit(DATA.train, epochs=1, batch_size=32, save_dir=str(ckpts))
    assert not dead.exists() and alive.exists()
