"""Experiment trackers beside wandb: TensorBoard and MLflow (`logger=tensorboard`, `logger=mlflow`,
or several: `logger=[wandb,tensorboard]`).

Each writes from rank 0 only (`rank_zero_only`), from the CLI and from the Python API alike; what
it logs is what `WandbLogger` logs: `train/<key>` at logging points, `epoch/<key>` at each epoch's
end, against the optimizer step. A tracker that cannot reach its server falls back to local files
with one line and never stops training; MLflow's calls are made from a thread of their own, so a
server that dies mid-run costs a logging point nothing (`framework.observe.background`).

The CLI fills `output_dir` (the job's dir), `run_config` (the resolved config) and, in a sweep,
`group` (the sweep's dir name) and `name` (the job's overrides), as it does for wandb.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from framework.errors import ConfigError
from framework.observe.background import Background
from framework.observe.callbacks import Callback
from framework.observe.state import LoopState


def _numbers(data: dict[str, Any], prefix: str) -> dict[str, float]:
    return {
        f"{prefix}/{k}": float(v)
        for k, v in data.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _flat(config: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as `a.b.c -> value` strings (what a tracker's params hold)."""
    if isinstance(config, dict):
        out: dict[str, str] = {}
        for key, value in config.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): str(config)}


class _Tracker(Callback):
    """What both trackers log: `train/<key>` at logging points, `epoch/<key>` at epoch ends."""

    stops_alike = True  # never stops training between steps

    rank_zero_only = True

    def _log(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def on_step_end(self, state: LoopState) -> None:
        """Step metrics at logging points."""
        if state.log_now:
            self._log(_numbers(state.logs, "train"), state.global_step)

    def on_epoch_end(self, state: LoopState) -> None:
        """The epoch summary."""
        self._log(_numbers(state.logs, "epoch"), state.global_step)


class TensorBoardLogger(_Tracker):
    """Scalars in TensorBoard event files: `<output_dir>/tensorboard` by default (`log_dir` to
    change), so `tensorboard --logdir` on a sweep's dir shows each job as its own run. The
    resolved config is written once as text."""

    def __init__(self, log_dir: str | None = None, output_dir: str | None = None, run_config: Any = None):
        self.log_dir = log_dir or str(Path(output_dir or ".") / "tensorboard")
        self.run_config = run_config
        self.writer: Any = None

    def on_fit_start(self, state: LoopState) -> None:
        """Open the event file (and keep the config beside the scalars)."""
        from torch.utils.tensorboard import SummaryWriter

        try:
            self.writer = SummaryWriter(self.log_dir)
        except OSError as exc:  # a file on the path, a read-only file system, no permission
            raise ConfigError(
                f"TensorBoard's log dir {self.log_dir} cannot be written ({exc.strerror or exc}); set "
                "logger.tensorboard.log_dir (TensorBoardLogger(log_dir=...)) to a dir that can be"
            ) from None
        if self.run_config is not None:
            lines = [f"    {k}: {v}" for k, v in _flat(self.run_config).items()]
            self.writer.add_text("config", "\n".join(lines), 0)

    def _log(self, values: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def on_fit_end(self, state: LoopState) -> None:
        """Flush and close the event file."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def reachable(uri: str, timeout: float = 2.0) -> bool:
    """Whether an http(s) tracking server answers a TCP connection within `timeout` seconds (a
    local store is always reachable). MLflow's own client retries for minutes before it gives up."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return True
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "localhost", port), timeout=timeout):
            return True
    except OSError:
        return False


START_S = 30.0  # what a server's first answers (the experiment, the run, the params) may take


class MLflowLogger(_Tracker):
    """A run in MLflow: params from the resolved config, metrics per optimizer step, the final
    metrics at the end, and the run dir's own files as artifacts when `log_artifacts`.
    `tracking_uri`: a server (`http://host:5000`) or a store; None: a local store,
    `mlruns/mlflow.db` (SQLite, MLflow's file store being retired) with `mlruns/artifacts`, in the
    sweep's dir (a sweep) or the run's dir. `experiment`: the sweep's name in a sweep, else
    `hydraspeed`.

    Every call to MLflow is made from a thread of its own (`Background`): a logging point never
    waits on the server; a call to a server that has not returned within `timeout_s` seconds (a
    server that died: MLflow's client retries for minutes; `START_S` for the calls that start the
    run) ends the logging with one line, and the run's end waits at most that long for what is
    still queued. A local store (a file, SQLite) has no server to wait for: its calls are never
    cut short."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        output_dir: str | None = None,
        run_config: Any = None,
        group: str | None = None,
        name: str | None = None,
        log_artifacts: bool = False,
        timeout_s: float = 5.0,
    ):
        out = Path(output_dir or ".").resolve()
        self.local_store = (out.parent if group else out) / "mlruns"  # MLflow's file store is retired
        self.local_uri = f"sqlite:///{self.local_store / 'mlflow.db'}"
        self.tracking_uri = tracking_uri or self.local_uri
        self.experiment = experiment or group or "hydraspeed"
        self.output_dir, self.run_config, self.name = output_dir, run_config, name
        self.log_artifacts, self.timeout_s = log_artifacts, float(timeout_s)
        self.client: Any = None
        self.run_id: str | None = None
        self.sender: Background | None = None

    def on_fit_start(self, state: LoopState) -> None:
        """Start the run and log the params, from the sender's thread."""
        self.sender = Background("mlflow", self.tracking_uri, self.timeout_s)
        self.sender.submit(self._start)

    def _start(self) -> None:
        """Start the run (on a local store when the server cannot be reached) and log the params."""
        import logging

        assert self.sender is not None
        self.sender.timed(False)  # importing MLflow is no server's answer
        for logger in ("mlflow", "alembic"):  # "Creating initial MLflow database tables..." and the like
            logging.getLogger(logger).setLevel(logging.WARNING)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri
        if not reachable(uri):
            print(f"mlflow: {uri} cannot be reached; logging to {self.local_uri} instead", file=sys.stderr)
            uri = self.local_uri
        if uri == self.local_uri:
            self.local_store.mkdir(parents=True, exist_ok=True)
        remote = urlparse(uri).scheme not in ("", "file", "sqlite")  # a server, not a local store
        if remote:  # its first answers (the experiment, the run) may come slowly: START_S for them
            self.sender.timed(True, max(START_S, self.timeout_s))
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(self.experiment)
        artifacts = (self.local_store / "artifacts").as_uri() if uri == self.local_uri else None
        experiment_id = found.experiment_id if found else client.create_experiment(self.experiment, artifacts)
        self.run_id = client.create_run(experiment_id, run_name=self.name).info.run_id
        self.client, self.tracking_uri = client, uri
        if self.run_config is not None:
            params = [Param(k, v[:6000]) for k, v in _flat(self.run_config).items()]
            for at in range(0, len(params), 100):  # MLflow takes at most 100 params per call
                client.log_batch(self.run_id, params=params[at : at + 100])
        if remote:  # from here each call has timeout_s to return
            self.sender.timed(True)

    def _log(self, values: dict[str, float], step: int) -> None:
        if self.sender is not None and values:
            self.sender.submit(self._send, values, step, int(time.time() * 1000))

    def _send(self, values: dict[str, float], step: int, at_ms: int) -> None:
        if self.client is None:  # the run could not be started (said once)
            return
        from mlflow.entities import Metric

        self.client.log_batch(self.run_id, metrics=[Metric(k, v, at_ms, step) for k, v in values.items()])

    def _upload_run_files(self) -> None:
        """The run dir's own files (config, metrics, logs, `.hydra/`) as the run's artifacts; never
        the local store (it is inside the run dir: copying it into itself never ended) nor the
        checkpoints or the other trackers' dirs."""
        if self.client is None or not self.output_dir:
            return
        out = Path(self.output_dir)
        for file in sorted(p for p in out.iterdir() if p.is_file()):
            self.client.log_artifact(self.run_id, str(file))
        if (out / ".hydra").is_dir():
            self.client.log_artifacts(self.run_id, str(out / ".hydra"), ".hydra")

    def on_fit_end(self, state: LoopState) -> None:
        """The final metrics, the artifacts when asked, and the run's end; then wait at most
        `timeout_s` for what is still queued (nothing when the server stopped answering)."""
        if self.sender is None:
            return
        final = {k: v[-1] for k, v in state.history.items() if v}
        self._log(_numbers(final, "final"), state.global_step)
        if self.log_artifacts:
            self.sender.submit(self._upload_run_files)
        self.sender.submit(lambda: self.client is not None and self.client.set_terminated(self.run_id))
        self.sender.close()
        self.sender = None
