"""TensorBoard and MLflow beside wandb: event files TensorBoard's own reader reads, an MLflow run on
a real local server with the params and the per-step metrics, one writer on 2 processes, and a
server that cannot be reached falling back to local files without stopping training."""

from __future__ import annotations

import functools
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from framework import Engine
from framework.models import MLP
from framework.observe.trackers import MLflowLogger, TensorBoardLogger
from framework.process.environment import free_port

from ..conftest import FAST, run_train, subprocess_env

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the event files under `log_dir`, read by TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_runs(uri: str, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r} at {uri}"
    return [(run, client) for run in client.search_runs([found.experiment_id])]


def test_the_api_writes_tensorboard_events_and_an_unreachable_mlflow_falls_back_to_local_files(
    tmp_path, capsys
):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    board = TensorBoardLogger(log_dir=str(tmp_path / "tb"), run_config={"optimizer": {"lr": 0.1}})
    flow = MLflowLogger(tracking_uri=dead, output_dir=str(tmp_path), run_config={"optimizer": {"lr": 0.1}})
    data = torch.utils.data.TensorDataset(torch.randn(96, 64), torch.randint(0, 10, (96,)))
    engine = Engine(
        MLP(hidden=[16]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
        callbacks=[board, flow],
    )  # fmt: skip
    start = time.perf_counter()
    engine.fit(data, epochs=2, batch_size=8, log_freq=4)
    assert time.perf_counter() - start < 30
    series = scalars(tmp_path / "tb")
    assert [step for step, _ in series["train/loss"]] == [4, 8, 12, 16, 20, 24]
    assert [step for step, _ in series["epoch/loss"]] == [12, 24]
    err = capsys.readouterr().err
    local = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    assert f"mlflow: {dead} cannot be reached; logging to {local} instead" in err
    ((run, client),) = mlflow_runs(local, "hydraspeed")
    assert run.data.params == {"optimizer.lr": "0.1"}
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [
        4,
        8,
        12,
        16,
        20,
        24,
    ]
    assert run.info.status == "FINISHED" and "final/loss" in run.data.metrics


def test_several_loggers_compose_from_a_list(compose):
    cfg = compose(["logger=[wandb,tensorboard,mlflow]"])
    assert set(cfg.logger) == {"console", "wandb", "tensorboard", "mlflow"}


@pytest.fixture
def mlflow_server(tmp_path):
    """A real `mlflow server` on localhost for the test, stopped by its PID at the end."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
            "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--default-artifact-root", str(tmp_path / "artifacts"), "--workers", "1",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail("mlflow server exited at start")
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not answer within 60 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_two_processes_log_once_to_a_real_mlflow_server_tensorboard_and_wandb(tmp_path, mlflow_server):
    run = run_train(
        [
            "logger=[wandb,tensorboard,mlflow]", f"logger.mlflow.tracking_uri={mlflow_server}",
            "logger.mlflow.experiment=trackers", "trainer.devices=2", *FAST,
        ],
        tmp_path / "run",
        env=subprocess_env(WANDB_MODE="offline"),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    ((found, client),) = mlflow_runs(mlflow_server, "trackers")  # one run: rank 0 alone wrote
    assert found.data.params["trainer.batch_size"] == "64" and found.data.params["trainer.devices"] == "2"
    steps = [m.step for m in client.get_metric_history(found.info.run_id, "train/loss")]
    assert steps == [5, 10, 15, 20]
    assert "final/loss" in found.data.metrics
    event_files = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 1
    assert [s for s, _ in scalars(tmp_path / "run" / "tensorboard")["train/loss"]] == steps
