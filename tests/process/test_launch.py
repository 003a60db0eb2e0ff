"""Launching: N local workers (torch elastic), joining torchrun / deepspeed / two "nodes",
Hydra multirun sweeps, Optuna and the submitit launcher. Real processes, real gloo groups."""

from __future__ import annotations

import json
import shutil
import sys
import time

import pytest
import yaml

from framework import ConfigError
from framework.cli.main import launch_job
from framework.process.environment import free_port, launched

from ..conftest import FAST, ROOT, final_metrics, popen, run_cmd, run_train

pytestmark = pytest.mark.timeout(400)


@pytest.mark.slow
def test_devices_2_trains_and_returns_rank0_metric(compose, tmp_path):
    cfg = compose(["+strategy=zero3", "trainer.devices=2", *FAST])
    value = launch_job(cfg, str(tmp_path))  # spawns 2 workers from this process
    final = final_metrics(tmp_path)
    assert value == pytest.approx(final["val_loss"])
    assert final["step"] == 22
    assert not launched()  # the parent never joined a group


@pytest.mark.slow
def test_a_worker_that_raises_fails_the_job_fast_naming_the_rank(tmp_path):
    boom = "+callbacks.boom={_target_:tests.helpers.RaiseOnRank,rank:1,step:3}"
    start = time.monotonic()
    run = run_train(["+strategy=zero3", "trainer.devices=2", "trainer.epochs=3", boom], tmp_path, timeout=120)
    elapsed = time.monotonic() - start
    assert run.returncode != 0
    assert "worker rank 1 failed" in run.stderr
    assert "RuntimeError: injected failure on rank 1 at step 3" in run.stderr  # that rank's traceback
    assert run.stderr.count("RuntimeError: injected failure") == 1  # printed once, not again by the agent
    assert elapsed < 60  # not the 300 s collective timeout


@pytest.mark.slow
def test_devices_must_agree_with_the_launcher(tmp_path):
    run = run_train(["trainer.devices=3", *FAST], tmp_path, nproc=2)
    assert run.returncode != 0
    assert "trainer.devices=3 but the launcher started 2 processes" in run.stdout + run.stderr


@pytest.mark.slow
def test_devices_beyond_the_machine_is_a_clear_error(tmp_path):
    run = run_train(["trainer.devices=64"], tmp_path)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "trainer.devices=64 but this machine has" in run.stderr and "torchrun" in run.stderr


@pytest.mark.slow
def test_two_nodes_with_torchrun_match_one_node(tmp_path):
    """Two torchrun processes on this machine as two 'nodes' of one ZeRO-3 job."""
    port = free_port()
    args = ["+strategy=zero3", *FAST, f"hydra.run.dir={tmp_path / 'nodes'}"]
    procs = [
        popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                str(ROOT / "train.py"),
                *args,
            ]
        )
        for node in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    single = run_train(["+strategy=zero3", "trainer.devices=2", *FAST], tmp_path / "single")
    assert single.returncode == 0, single.stderr[-2000:]
    two_nodes, one_node = final_metrics(tmp_path / "nodes"), final_metrics(tmp_path / "single")
    assert two_nodes["loss"] == pytest.approx(one_node["loss"], rel=1e-4)
    assert two_nodes["val_loss"] == pytest.approx(one_node["val_loss"], rel=1e-4)


@pytest.mark.slow
def test_deepspeed_launcher_runs_train_py(tmp_path):
    launcher = shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the deepspeed launcher script is not on PATH")
    run = run_cmd(
        [
            launcher,
            "--num_gpus",
            "2",
            str(ROOT / "train.py"),
            "+strategy=zero2",
            *FAST,
            f"hydra.run.dir={tmp_path}",
        ],
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 process(es)" in run.stdout and final_metrics(tmp_path)["step"] == 22


@pytest.mark.slow
def test_multirun_2x2_with_two_devices_per_job(tmp_path):
    args = [
        "-m",
        "+strategy=zero1,zero3",
        "optimizer.lr=1e-3,3e-4",
        "trainer.devices=2",
        *FAST,
        f"hydra.sweep.dir={tmp_path}",
    ]
    run = run_cmd([sys.executable, str(ROOT / "train.py"), *args], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    jobs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert jobs == ["0", "1", "2", "3"]
    assert len(list(tmp_path.glob("**/multirun.yaml"))) == 1
    for job in jobs:
        assert final_metrics(tmp_path / job)["step"] == 22
        assert (tmp_path / job / "metrics.jsonl").read_text().count(
            '"kind": "epoch"'
        ) == 1  # rank 0 alone wrote
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [row["status"] for row in summary] == ["ok"] * 4
    combos = {tuple(row["overrides"].split()[:2]) for row in summary}
    assert combos == {
        (f"strategy={s}", f"optimizer.lr={lr}") for s in ("zero1", "zero3") for lr in ("0.001", "0.0003")
    }
    # the same settings give the same numbers under ZeRO-1 and ZeRO-3
    assert final_metrics(tmp_path / "0")["val_loss"] == pytest.approx(
        final_metrics(tmp_path / "2")["val_loss"], rel=1e-4
    )


@pytest.mark.slow
def test_a_failed_sweep_job_fails_the_sweep_and_is_named(tmp_path):
    args = [
        "-m",
        "trainer.batch_size=64,63",
        "trainer.devices=2",
        "trainer.epochs=1",
        f"hydra.sweep.dir={tmp_path}",
    ]
    run = run_cmd([sys.executable, str(ROOT / "train.py"), *args], timeout=240)
    assert run.returncode != 0
    assert "global batch size 63 does not divide" in run.stderr
    assert "Traceback" not in run.stderr and "1 job(s) did not finish: 1 (trainer.batch_size=63" in run.stdout
    rows = {
        row["overrides"].split()[0]: row["status"]
        for row in json.loads((tmp_path / "summary.json").read_text())
    }
    assert rows == {"trainer.batch_size=64": "ok", "trainer.batch_size=63": "failed"}


@pytest.mark.slow
def test_optuna_search_runs_three_trials(tmp_path):
    args = [
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=3",
        "trainer.epochs=2",
        f"hydra.sweep.dir={tmp_path}",
    ]
    run = run_cmd([sys.executable, str(ROOT / "train.py"), *args], timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "setup plugin" not in run.stdout + run.stderr  # alembic's INFO lines, nothing to act on
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert set(results["best_params"]) == {"optimizer.lr", "trainer.batch_size"}
    values = [final_metrics(tmp_path / str(i))["val_loss"] for i in range(3)]
    assert results["best_value"] == pytest.approx(min(values))


@pytest.mark.slow
def test_submitit_local_launcher_runs_a_job(tmp_path):
    args = ["-m", "hydra/launcher=submitit_local", *FAST, f"hydra.sweep.dir={tmp_path}"]
    run = run_cmd([sys.executable, str(ROOT / "train.py"), *args], timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert final_metrics(tmp_path / "0")["step"] == 22


def test_devices_under_a_launcher_count_processes_per_machine(monkeypatch):
    from framework import ProcessContext
    from framework.process.launch import check_launched_devices

    here = ProcessContext.from_launcher  # what the launcher's variables say this process is

    # two machines of four processes each (torchrun --nnodes=2 --nproc-per-node=4, or Slurm)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_launched_devices(4, here())  # the README's Slurm command: trainer.devices=4 hydra.launcher.nodes=2
    check_launched_devices(1, here())  # the default always agrees
    with pytest.raises(
        ConfigError, match=r"started 4 processes on this machine \(8 in all\); .* set it to 4"
    ):
        check_launched_devices(8, here())
    # DeepSpeed's launcher says LOCAL_SIZE; with neither, the whole world is on this machine
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "2")
    with pytest.raises(ConfigError, match="started 2 processes on this machine"):
        check_launched_devices(4, here())
    monkeypatch.delenv("LOCAL_SIZE")
    check_launched_devices(8, here())
