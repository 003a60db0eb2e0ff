"""What a researcher sees: clear errors for every bad input, console output, metrics files,
plots, wandb, callbacks and --help."""

from __future__ import annotations

import json
import sys

import pytest

from framework.plot import plot

from ..conftest import FAST, ROOT, final_metrics, run_cmd, run_train, subprocess_env

ERRORS = {
    "unknown option": (
        ["model=resnet"],
        [
            "unknown model 'resnet'",
            "cnn, gpt, hf_causal_lm, hf_gpt2, hf_llama, hf_mixtral, hf_sequence_classification, mlp",
        ],
    ),
    "unknown option, + form": (["+metrics=f1"], ["unknown metrics 'f1'", "accuracy, none"]),
    "typo'd key": (["trainer.epoch=3"], ["trainer.epoch", "did you mean 'trainer.epochs'"]),
    "typo'd key, untyped group": (
        ["model=cnn", "optimizer.lrr=1"],
        ["optimizer.lrr", "did you mean 'optimizer.lr'"],
    ),
    "typo'd key of the chosen option": (
        ["model=cnn", "model.hiden=3"],
        ["model.hiden", "valid keys here", "channels"],
    ),
    "wrong type": (["trainer.batch_size=big"], ["trainer.batch_size=big", "expected an integer"]),
    "uneven batch": (
        ["trainer.batch_size=100", "strategy.gradient_merge.k_steps=8"],
        ["global batch size 100", "multiple of 8"],
    ),
    "pipeline + ZeRO-3": (
        ["strategy=pipeline", "strategy.sharding.stage=3", "trainer.devices=2"],
        ["cannot run with ZeRO stage 3"],
    ),
    "pipeline + ZeRO-2": (
        ["strategy=pipeline", "strategy.sharding.stage=2", "trainer.devices=2"],
        ["cannot run with ZeRO stage 2"],
    ),
    "stages vs processes": (
        ["strategy=pipeline", "strategy.pipeline.stages=3", "trainer.devices=2"],
        ["stages=3 does not divide the 2 processes"],
    ),
    "too many devices": (["trainer.devices=64"], ["trainer.devices=64 but this machine has", "torchrun"]),
    "offload on stage 2": (
        ["strategy=zero2", "strategy.sharding.offload_params=true"],
        ["offload_params needs ZeRO stage 3"],
    ),
    "missing dataset file": (
        ["data=csv", "data.dataset.path=/nonexistent/table.csv"],
        ["/nonexistent/table.csv", "no such file"],
    ),
    "unimportable target": (
        ["model._target_=framework.models.Nope"],
        ["model._target_=framework.models.Nope", "cannot be imported"],
    ),
    "output key the model lacks": (
        ["model=hf_gpt2", "data=chars", "loss=lm", "trainer.output_key=nope"],
        ["trainer.output_key=nope", "has no such field", "use one of: logits"],
    ),
    "loss=model, model without labels=": (
        ["loss=model"],
        ["loss=model needs a model that takes labels=", "MLP.forward does not", "loss=cross_entropy"],
    ),
    "loss becomes NaN": (
        ["optimizer=sgd", "optimizer.lr=1e6", "trainer.epochs=1"],
        ["loss became nan", "at step"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_ends_with_a_short_clear_message(tmp_path, case):
    args, words = ERRORS[case]
    run = run_train(args, tmp_path)
    assert run.returncode != 0
    assert "Traceback" not in run.stdout + run.stderr, run.stderr[-3000:]
    error_lines = [line for line in run.stderr.splitlines() if line.strip()]
    message = "\n".join(error_lines)
    for word in words:
        assert word in message, message
    assert len([line for line in error_lines if line.startswith("Error:")]) == 1
    assert len(error_lines) <= 3, message


@pytest.mark.slow
def test_verbose_shows_the_traceback(tmp_path):
    run = run_train(["model._target_=framework.models.Nope", "trainer.verbose=true"], tmp_path)
    assert run.returncode != 0 and "Traceback" in run.stderr


@pytest.mark.slow
def test_a_nan_loss_keeps_the_last_good_checkpoint(tmp_path):
    run = run_train(["optimizer=sgd", "optimizer.lr=1e6", "trainer.checkpoint.save_freq=1"], tmp_path)
    assert run.returncode != 0
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_"))
    bad_step = int(run.stderr.split("at step ")[1].split()[0])
    assert saved and int(saved[-1].split("_")[1]) == bad_step - 1  # nothing saved at or after the bad step


@pytest.mark.slow
def test_metrics_jsonl_and_files_after_a_short_run(tmp_path):
    run = run_train([*FAST, "trainer.log_freq=4"], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [4, 8, 12, 16, 20]
    assert all({"loss", "lr", "batches", "samples", "epoch"} <= set(r) for r in steps)
    assert steps[-1]["samples"] == 20 * 64
    (epoch,) = [r for r in records if r["kind"] == "epoch"]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(epoch)
    for name in ("config.yaml", "deepspeed_config.json", "final_metrics.json"):
        assert (tmp_path / name).is_file()
    assert (tmp_path / "checkpoints" / "latest").is_file()


@pytest.mark.slow
def test_non_tty_output_has_plain_lines_and_a_summary(tmp_path):
    run = run_train([*FAST], tmp_path)
    assert "\r" not in run.stdout and "\x1b[" not in run.stdout  # no redraws or colour codes in a log file
    assert "epoch 1/1 step 5 batch 5/22 loss" in run.stdout
    assert "run summary" in run.stdout and f"outputs in {tmp_path}" in run.stdout
    # a first run prints nothing a user cannot act on: no warnings, no MFU hint on a CPU; its one
    # note is the samples each epoch leaves out, with the option that changes it
    assert "Warning" not in run.stdout + run.stderr and "warn" not in run.stderr.lower(), run.stderr
    notes = [line for line in run.stdout.splitlines() if "note:" in line]
    assert "peak_tflops" not in run.stdout and len(notes) == 1, notes
    assert "an epoch trains 1,408 of the 1,438 samples" in notes[0] and "trainer.batch_size" in notes[0]


@pytest.mark.slow
def test_terminal_output_draws_a_progress_bar(tmp_path):
    """Under a (pseudo) terminal the console draws a live bar instead of plain lines."""
    import os
    import pty
    import subprocess

    master, slave = pty.openpty()
    env = subprocess_env(COLUMNS="160")
    env.pop("CI", None)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *FAST, f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        stdout=slave,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=120)
    text = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0
    assert "samples/s" in text and "\r" in text  # redrawn in place
    assert "run summary" in text


@pytest.mark.slow
def test_plot_command_for_a_run_and_a_sweep(tmp_path):
    run = run_train([*FAST], tmp_path / "run")
    assert run.returncode == 0
    cli = run_cmd([sys.executable, "-m", "framework.plot", str(tmp_path / "run")])
    assert cli.returncode == 0, cli.stderr
    for name in ("loss", "val_loss", "val_accuracy", "accuracy", "lr"):
        png = tmp_path / "run" / "plots" / f"{name}.png"
        assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = run_cmd(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "-m",
            "optimizer.lr=1e-3,3e-3",
            *FAST,
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ]
    )
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    written = plot([tmp_path / "sweep"])
    assert {p.name for p in written} >= {"loss.png", "val_loss.png"}
    assert all(p.stat().st_size > 1000 for p in written)


def _offline_runs(run_dir):
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


@pytest.mark.slow
def test_wandb_offline_run_holds_config_and_metrics(tmp_path):
    from ..helpers import read_wandb_run

    env = subprocess_env()
    env.pop("WANDB_MODE")  # no API key here: the logger must choose offline by itself
    env["WANDB_API_KEY"] = ""
    run = run_train(["logger=wandb", *FAST], tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "wandb: offline run (no API key); upload later with: wandb sync" in run.stdout
    (path,) = _offline_runs(tmp_path)
    records = read_wandb_run(path)
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in run_record.config.update}
    assert config["trainer"]["epochs"] == 1 and config["model"]["_target_"] == "framework.models.MLP"
    history = [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    losses = [h["train/loss"] for h in history if "train/loss" in h]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert losses == [r["loss"] for r in logged if r["kind"] == "step"]
    assert any(
        h.get("epoch/val_accuracy") == pytest.approx(final_metrics(tmp_path)["val_accuracy"]) for h in history
    )


@pytest.mark.slow
def test_wandb_disabled_is_respected(tmp_path):
    # wandb from rank 0 only, on 2 processes: tests/observe/test_trackers.py (with the other trackers)
    run = run_train(["logger=wandb", *FAST], tmp_path / "off", env=subprocess_env(WANDB_MODE="disabled"))
    assert run.returncode == 0 and not (tmp_path / "off" / "wandb").exists()


@pytest.mark.slow
def test_an_unreachable_wandb_server_does_not_stop_training(tmp_path):
    env = subprocess_env(
        WANDB_MODE="online",
        WANDB_API_KEY="x" * 40,
        WANDB_BASE_URL="http://127.0.0.1:9",
        WANDB_INIT_TIMEOUT="5",
    )
    run = run_train(["logger=wandb", *FAST], tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "could not reach the server" in run.stderr and final_metrics(tmp_path)["step"] == 22


@pytest.mark.slow
def test_callbacks_early_stopping_keep_best_and_lr_monitor(tmp_path):
    args = [
        "callbacks=[early_stopping,keep_best,lr_monitor]",
        "callbacks.early_stopping.patience=1",
        "callbacks.early_stopping.monitor=val_accuracy",
        "callbacks.early_stopping.mode=max",
        "callbacks.early_stopping.min_delta=0.5",
        "trainer.epochs=5",
    ]
    run = run_train(args, tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "early stopping: val_accuracy did not improve for 1 validation(s)" in run.stdout
    final = final_metrics(tmp_path)
    assert final["step"] == 2 * 22  # stopped after the second epoch
    best = tmp_path / "best.safetensors"
    assert best.is_file() and final["best_val_loss"] == pytest.approx(final["val_loss"])


@pytest.mark.slow
def test_help_lists_groups_and_options():
    run = run_cmd([sys.executable, str(ROOT / "train.py"), "--help"])
    assert run.returncode == 0 and "+strategy=zero3" in run.stdout
    lines = run.stdout.splitlines()
    for group in ("strategy", "model", "data", "logger"):  # one line per option, from its own file
        options = sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
        at = lines.index(f"{group}:")
        assert [line.split()[0] for line in lines[at + 1 : at + 1 + len(options)]] == options
    assert "  sp2            Sequence parallelism over 2 ranks (DeepSpeed Ulysses)" in run.stdout
    assert "  sgd    torch.optim.SGD" in run.stdout  # no comment in the file: its target
    # the composed config shows current keys only, not the old names kept for old command lines
    assert "valid_freq: 1" in run.stdout
    assert not any(old in run.stdout for old in ("valid_every", "log_every", "every_n_steps"))


def test_plot_reads_records_from_before_a_rename_as_one_curve(tmp_path):
    """DPO's `rewards/accuracy` is TRL's `rewards/accuracies` now: a run resumed across the rename
    plots one curve."""
    from framework.plot import series

    records = [
        {"kind": "step", "step": 1, "loss": 0.7, "rewards/accuracy": 0.5},
        {"kind": "step", "step": 2, "loss": 0.6, "rewards/accuracies": 0.75},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert series(tmp_path)["rewards/accuracies"] == [(1, 0.5), (2, 0.75)]
