"""TensorBoard and MLflow beside wandb: event files TensorBoard's own reader reads, an MLflow run on
a real local server with the params and the per-step metrics, one writer on 2 processes, and a
server that cannot be reached falling back to local files without stopping training."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from framework import ConfigError, Engine
from framework.models import MLP
from framework.observe.trackers import MLflowLogger, TensorBoardLogger
from framework.process.environment import free_port

from ..conftest import FAST, ROOT, run_train, subprocess_env

pytest.importorskip("tensorboard", reason="needs the trackers extra: pip install -e '.[trackers]'")
pytest.importorskip("mlflow", reason="needs the trackers extra: pip install -e '.[trackers]'")


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
        MLP(hidden=[16]),
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        callbacks=[board, flow],
    )
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
def mlflow_server_process(tmp_path):
    """A real `mlflow server` on localhost for the test (without its job runner): its URL and its
    process, the leader of a process group of its own (uvicorn runs in a child), which the end
    of the test stops by that PID."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--default-artifact-root",
            str(tmp_path / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=subprocess_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
    )
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
        yield url, proc
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    """End the process group `proc` leads (TERM, then KILL after 20 s)."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 20)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture
def mlflow_server(mlflow_server_process):
    """The URL of a real `mlflow server` on localhost."""
    return mlflow_server_process[0]


@pytest.mark.slow
def test_two_processes_log_once_to_a_real_mlflow_server_tensorboard_and_wandb(tmp_path, mlflow_server):
    run = run_train(
        [
            "logger=[wandb,tensorboard,mlflow]",
            f"logger.mlflow.tracking_uri={mlflow_server}",
            "logger.mlflow.experiment=trackers",
            "trainer.devices=2",
            *FAST,
        ],
        tmp_path / "run",
        env=subprocess_env(WANDB_MODE="offline"),
    )
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


class Records(logging.Handler):
    """The log records a logger emits."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_mlflow_artifacts_on_the_local_store_are_the_run_files_once_and_quiet(tmp_path):
    """The local store is inside the run dir: logging the run dir as artifacts copied the store into
    itself, level after level (66 MB for a 26 k-parameter MLP), then failed."""
    (tmp_path / "config.yaml").write_text("optimizer:\n  lr: 0.1\n")
    flow = MLflowLogger(output_dir=str(tmp_path), log_artifacts=True)
    data = torch.utils.data.TensorDataset(torch.randn(32, 64), torch.randint(0, 10, (32,)))
    engine = Engine(
        MLP(hidden=[16]),
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        callbacks=[flow],
    )
    said = Records()
    logging.getLogger("mlflow").addHandler(said)
    try:
        engine.fit(data, epochs=1, batch_size=8, save_dir=str(tmp_path / "checkpoints"))
    finally:
        logging.getLogger("mlflow").removeHandler(said)
    artifacts = tmp_path / "mlruns" / "artifacts"
    logged = sorted(p.name for p in artifacts.glob("*/artifacts/*"))
    assert logged == ["config.yaml"]  # not the store, not the checkpoints
    assert [
        r.getMessage() for r in said.records if r.levelno < logging.WARNING
    ] == []  # "Creating initial ..."
    ((run, _),) = mlflow_runs(flow.local_uri, "hydraspeed")
    assert run.info.status == "FINISHED"


def test_a_tensorboard_dir_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    board = TensorBoardLogger(log_dir=str(tmp_path / "file" / "tb"))
    data = torch.utils.data.TensorDataset(torch.randn(16, 64), torch.randint(0, 10, (16,)))
    engine = Engine(
        MLP(hidden=[16]),
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        callbacks=[board],
    )
    with pytest.raises(
        ConfigError, match=r"TensorBoard's log dir .*file/tb cannot be written \(Not a directory\)"
    ):
        engine.fit(data, epochs=1, batch_size=8)


def steps_logged(run_dir) -> int:
    """The last step `metrics.jsonl` records (0 before the first)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return max((json.loads(line).get("step", 0) for line in lines[:-1]), default=0)  # the last may be partial


def wait_for(condition, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout_s} s for {what}")
        time.sleep(0.1)


@pytest.mark.slow
def test_a_tracking_server_killed_mid_run_never_holds_training_and_sigterm_still_saves(
    tmp_path, mlflow_server_process
):
    """The audit's case: the server killed mid-run froze training for good (MLflow's client retries
    for minutes) and SIGTERM could not end it. Training goes on, one line says what is dropped, and
    SIGTERM saves a checkpoint and exits 75."""
    from mlflow.tracking import MlflowClient

    url, server = mlflow_server_process
    run_dir = tmp_path / "run"
    args = [
        "logger=mlflow",
        f"logger.mlflow.tracking_uri={url}",
        "logger.mlflow.timeout_s=2",
        "trainer.epochs=100000",
    ]
    cmd = [sys.executable, str(ROOT / "train.py"), *args, "trainer.log_freq=1", f"hydra.run.dir={run_dir}"]
    with (
        open(tmp_path / "out", "w") as out_file,
        open(tmp_path / "err", "w") as err_file,
    ):  # never a full pipe
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=subprocess_env(), stdout=out_file, stderr=err_file, start_new_session=True
        )
    try:
        client = MlflowClient(tracking_uri=url)

        def logged_to_server() -> bool:
            found = client.get_experiment_by_name("hydraspeed")
            runs = client.search_runs([found.experiment_id]) if found else []
            return bool(runs) and bool(client.get_metric_history(runs[0].info.run_id, "train/loss"))

        wait_for(logged_to_server, "the first metrics on the server")
        stop_group(server)  # killed mid-run, by its PID
        killed_at = steps_logged(run_dir)
        wait_for(lambda: "mlflow: " in (tmp_path / "err").read_text(), "the line saying what is dropped")
        said_at = steps_logged(run_dir)
        wait_for(lambda: steps_logged(run_dir) > said_at + 50, "training to go on")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert proc.returncode == 75, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("mlflow:")]
    assert said == [
        f"mlflow: {url} has not answered for 2 s; logging to it stops here and what cannot be sent is dropped "
        "(metrics.jsonl has every value)"
    ], err[-3000:]
    assert "Traceback" not in err
    assert steps_logged(run_dir) > killed_at
    assert "preempted (SIGTERM): checkpoint saved at step" in out
