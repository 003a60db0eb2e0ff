"""Faults and bad inputs that used to pass silently, leak disk or end in a traceback: each one is
refused or named in one line. In-process where the behaviour allows it; the CLI cases share
subprocesses, and every wait on another process has its own bound."""

from __future__ import annotations

import functools
import json
import shutil
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

from framework import CheckpointError, ConfigError, Engine, NonFiniteLoss, Strategy
from framework.checkpoint import store
from framework.data.datasets import csv_classification, synthetic
from framework.models import MLP

from ..conftest import end_group

pytestmark = pytest.mark.timeout(300)

DATA = synthetic(num_samples=512)


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
    end_group()
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
    from framework.recipe import tree_of
    from framework.recipe.options import monitor_of

    with pytest.raises(ConfigError, match=words):
        monitor_of(tree_of(compose(overrides)), has_valid=True)
    assert monitor_of(tree_of(compose(["trainer.monitor=val_accuracy"])), has_valid=True) == "val_accuracy"
    with pytest.raises(ConfigError, match="no validation data, so no val_"):
        monitor_of(tree_of(compose(["trainer.monitor=val_loss"])), has_valid=False)


def test_an_unwritten_monitor_follows_the_run(compose, capsys):
    """The default the user did not write is the validation loss when there is validation data
    and the training loss otherwise (said once); only a monitor the user wrote is held strictly."""
    from framework.recipe import tree_of
    from framework.recipe.options import monitor_of

    assert monitor_of(tree_of(compose()), has_valid=True) == "val_loss"
    assert capsys.readouterr().out == ""
    assert monitor_of(tree_of(compose()), has_valid=False) == "loss"
    assert "trainer.monitor: loss (no validation data" in capsys.readouterr().out


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
    end_group()
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


# ------------------------------------------------------------------------------------- one line each


class Payload:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def test_weights_files_that_cannot_be_loaded_are_named(tmp_path):
    from framework.backend.weights import load_weights

    marker = tmp_path / "marker"
    torch.save({"w": torch.zeros(2), "x": Payload(marker)}, tmp_path / "payload.pt")
    with pytest.raises(CheckpointError, match=r"payload.pt would run code when loaded \(it calls exec\)"):
        load_weights(tmp_path / "payload.pt")
    assert not marker.exists()
    (tmp_path / "garbage.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"garbage.safetensors cannot be read as a safetensors file \("):
        load_weights(tmp_path / "garbage.safetensors")
    torch.save({"w": torch.zeros(2)}, tmp_path / "renamed.safetensors")
    with pytest.raises(
        CheckpointError, match=r"renamed.safetensors cannot be read .* another suffix \(.pt\)"
    ):
        load_weights(tmp_path / "renamed.safetensors")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match=r"list.pt is not a state dict of tensors \(list\)"):
        load_weights(tmp_path / "list.pt")


@pytest.mark.parametrize("stage", [0, 3])
def test_weights_of_another_model_name_the_keys_and_shapes(stage):
    from framework.backend.weights import load_whole

    run = engine(stage)
    run.prepare("train", 32)
    state = {k: v.detach().clone() for k, v in MLP(hidden=[32]).state_dict().items()}
    wrong = dict(state, **{"features.0.weight": torch.zeros(16, 64)})
    with pytest.raises(
        CheckpointError, match=r"features.0.weight has shape \(16, 64\) in the file, \(32, 64\)"
    ):
        load_whole(run.module, stage == 3, wrong)
    extra = dict(state, extra=torch.zeros(1))
    del extra["features.0.bias"]
    with pytest.raises(CheckpointError, match=r"missing features.0.bias; unexpected extra"):
        load_whole(run.module, stage == 3, extra)
    load_whole(run.module, stage == 3, state)  # the right weights still load


def test_a_batch_larger_than_the_dataset_is_a_config_error():
    with pytest.raises(ConfigError, match="the training set has 10 samples: too few for 1 rank"):
        engine().fit(TensorDataset(torch.randn(10, 64), torch.zeros(10, dtype=torch.long)), batch_size=32)


def test_a_checkpoint_dir_that_cannot_be_written_is_one_config_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        ConfigError, match=r"checkpoint dir .*file/ckpts cannot be written \(Not a directory\)"
    ):
        engine().fit(DATA.train, epochs=1, batch_size=32, save_dir=str(tmp_path / "file" / "ckpts"))


def test_export_to_a_path_under_a_file_is_one_line(tmp_path, capsys):
    from framework.export import main

    ckpts = trained(tmp_path / "ckpts")
    (tmp_path / "file").write_text("x")
    assert main([str(ckpts), str(tmp_path / "file" / "w.safetensors")]) == 1
    err = capsys.readouterr().err
    assert (
        err
        == f"Error: cannot write {tmp_path}/file/w.safetensors ({tmp_path}/file is a file, not a dir); choose another path\n"
    )


def test_a_timeout_too_short_for_a_start_is_refused(compose):
    from framework.recipe import tree_of

    with pytest.raises(ConfigError, match=r"trainer.timeout_s=0.01: must be a finite number >= 5"):
        tree_of(compose(["trainer.timeout_s=0.01"]))


@pytest.mark.slow
def test_cli_one_liners(tmp_path):
    """init_from a pickle with a payload; a 10,000-character hydra.run.dir; a read-only checkpoint dir."""
    from ..conftest import FAST, ROOT, fails_cleanly, run_cmd, run_train

    marker = tmp_path / "marker"
    torch.save({"w": torch.zeros(2), "x": Payload(marker)}, tmp_path / "payload.pt")
    run = run_train(
        [*FAST, "trainer.max_steps=1", f"trainer.init_from={tmp_path / 'payload.pt'}"], tmp_path / "a"
    )
    fails_cleanly(run, f"Error: trainer.init_from={tmp_path / 'payload.pt'}: ", "would run code when loaded")
    assert not marker.exists()
    run = run_train(FAST, tmp_path / ("a" * 10_000), timeout=60)
    fails_cleanly(run, "Error: hydra.run.dir: a path of 10,", "choose a shorter one")
    assert run.stderr.count("\n") == 1
    ro = tmp_path / "ro"
    ro.mkdir()
    if shutil.which("unshare") is None:
        return
    train = f"{sys.executable} {ROOT / 'train.py'} {' '.join(FAST)} trainer.checkpoint.dir={ro} hydra.run.dir={tmp_path / 'b'}"
    run = run_cmd(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o ro none {ro} && {train}"], timeout=120)
    if "mount:" in run.stderr:
        pytest.skip("cannot mount a read-only filesystem here (needs unshare -rm)")
    fails_cleanly(run, f"Error: checkpoint dir {ro} cannot be written (Read-only file system)")


# ------------------------------------------------------------------------------------- bounded waits


@pytest.mark.parametrize("stage", [pytest.param("zero1", marks=pytest.mark.slow), "zero3"])
def test_a_stopped_peer_ends_the_job_within_the_timeout_naming_it(tmp_path, stage):
    """SIGSTOP on rank 1: on ZeRO-1 rank 0's watchdog fires, on ZeRO-3 gloo's own timeout comes
    first; either way one line names the stopped rank, which is ended (the launcher would wait 30 s
    for a stopped process to handle its SIGTERM)."""
    import time

    from ..conftest import FAST, run_train

    marker = tmp_path / "stopped_at"
    stop = f"+callbacks.stop={{_target_:tests.helpers.StopRank,rank:1,step:3,marker:{marker}}}"
    run = run_train(
        [stop, *FAST, f"strategy={stage}", "trainer.devices=2", "trainer.timeout_s=8"], tmp_path, timeout=150
    )
    ended = time.time()
    text = run.stdout + run.stderr
    assert run.returncode == 1, text[-3000:]
    assert "rank 1 (pid " in text and "is stopped (SIGSTOP): ended" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert ended - float(marker.read_text()) < 8 + 12, ended - float(marker.read_text())


@pytest.mark.slow
def test_a_stop_asked_on_one_rank_stops_every_rank_at_once(tmp_path):
    """A callback that stops training on one rank only (rank 1, so the rank that reports learns
    it from the other) ends every rank at that step, or after that epoch; each rank's next step
    used to wait in its collectives for the timeout, then fail."""
    from ..conftest import FAST, final_metrics, run_train, train_aside

    def args(when: str) -> list[str]:
        stop = f"+callbacks.stop={{_target_:tests.helpers.StopTrainingOnRank,rank:1,{when}}}"
        return [stop, *FAST, "trainer.epochs=3", "trainer.devices=2", "trainer.timeout_s=8"]

    with train_aside(args("epoch:1"), tmp_path / "epoch", timeout=120) as after_epoch:
        at_step = run_train(args("step:3"), tmp_path / "step", timeout=120)
        epoch_end = after_epoch.result()
    for run, steps in ((at_step, 3), (epoch_end, 22)):  # an epoch is 22 steps of a global batch of 64
        text = run.stdout + run.stderr
        assert run.returncode == 0, text[-3000:]
        assert (
            f"done: {steps} optimizer steps" in run.stdout
            and "(training stopped on another rank)" in run.stdout
        )
    assert final_metrics(tmp_path / "step")["step"] == 3 and final_metrics(tmp_path / "epoch")["step"] == 22


@pytest.mark.slow
def test_long_work_is_bounded_by_a_multiple_of_the_timeout():
    """A save whose peers never come (rank 0 waits in the slow group's 12-hour barrier) ends at
    LONG_WORK x timeout_s with one line saying what it was doing."""
    from ..conftest import run_cmd

    script = (
        "import time\n"
        "from framework.process import watchdog\n"
        "with watchdog.watching(1.5):\n"
        "    with watchdog.suspended(watchdog.LONG_WORK, 'saving a checkpoint'):\n"
        "        time.sleep(60)\n"
    )
    start = __import__("time").monotonic()
    run = run_cmd([sys.executable, "-c", script], timeout=60)
    elapsed = __import__("time").monotonic() - start
    assert run.returncode == 1
    assert "made no progress for 6 s while saving a checkpoint (allowed: 4 x trainer.timeout_s)" in run.stderr
    assert elapsed < 6 + 10, elapsed


@pytest.mark.slow
def test_a_stopped_conversion_is_ended_with_one_line(tmp_path):
    """DeepSpeed's ds_to_universal stopped (SIGSTOP) during a conversion for another world size:
    killed before the watchdog's limit, a CheckpointError says so."""
    from ..conftest import run_cmd

    ckpts = trained(tmp_path / "ckpts", stage=2)
    script = f"""
import os, signal, threading, time
from pathlib import Path
from framework import CheckpointError
from framework.process import watchdog
from framework.checkpoint import store

def stop_the_converter():
    while True:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:  # only a child of this process: the converter
                cmd = open(f"/proc/{{pid}}/cmdline", "rb").read()
                parent = int(open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if b"ds_to_universal" in cmd and parent == os.getpid():
                os.kill(int(pid), signal.SIGSTOP)
                return
        time.sleep(0.02)

threading.Thread(target=stop_the_converter, daemon=True).start()
start = time.monotonic()
with watchdog.watching(2.5):
    try:
        with watchdog.suspended(watchdog.LONG_WORK, "loading a checkpoint"):
            store.to_universal(store.find_resumable(Path({str(ckpts)!r})))
    except CheckpointError as exc:
        print("error:", exc, round(time.monotonic() - start))
"""
    run = run_cmd([sys.executable, "-c", script], timeout=90)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "error: converting" in run.stdout and "ds_to_universal was stopped or is stuck" in run.stdout, (
        run.stdout
    )
    assert (
        int(run.stdout.split()[-1]) <= 4 * 2.5 + 2
    )  # LONG_WORK x timeout: the watchdog did not need to fire
    assert [p.name for p in ckpts.iterdir() if store.CONVERTING in p.name] == []
