"""hydraspeed's Slurm launcher for Hydra (`hydra/launcher=slurm`): hydra-submitit-launcher's,
with what Slurm refuses said in one line. (Hydra takes launchers only from the `hydra_plugins`
namespace, hence this package beside `framework`.)

* A submission sbatch rejects (a GPU request on a CPU cluster, memory no node has) ends the
  sweep with sbatch's own message, not a traceback.
* A job that ended without finishing (preempted and not requeued, killed) ends the sweep with
  its summary and one line, not a traceback.
* A job Slurm accepted but can never start (more CPUs per node than the partition allows: it
  would stay PENDING with `Reason=PartitionConfig` while the launcher waits forever) is
  cancelled within seconds, with the reason.

Preemption and time limits need nothing here: the jobs save, and submitit's own handler requeues
them (framework.checkpoint.preemption).
"""

from __future__ import annotations

import _thread
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Hydra imports every hydra_plugins module at start-up, in every Hydra app of the environment:
# nothing heavy at import, and no error where the `sweep` extra (hydra-submitit-launcher) is missing.
try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
        SlurmLauncher as _SubmititSlurmLauncher,
    )
except ImportError:
    _SubmititSlurmLauncher = object

# squeue reasons that no waiting resolves: the request exceeds what the partition or account allows.
NEVER_STARTS = ("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints",
                "InvalidAccount", "InvalidQOS", "QOSMaxCpuPerJobLimit", "QOSMaxGRESPerJob")  # fmt: skip


def _sbatch_message(exc: BaseException) -> str:
    """sbatch's own error line out of submitit's exception text."""
    lines = [line.strip() for line in str(exc).splitlines() if "error" in line.lower()]
    return (lines[-1] if lines else str(exc).strip().splitlines()[-1]).removeprefix("Error: ")


class _PendingWatch(threading.Thread):
    """Cancels this sweep's jobs that Slurm says can never start, naming why."""

    def __init__(self, folder: str):
        super().__init__(name="hydraspeed-pending-watch", daemon=True)
        self.folder, self.stop = folder, threading.Event()
        self.reasons: dict[str, str] = {}  # job id -> squeue's reason

    def run(self) -> None:
        while not self.stop.wait(2.0):
            try:
                listed = subprocess.run(
                    ["squeue", "-h", "-t", "PENDING", "-o", "%i|%r|%o"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            for line in listed.splitlines():
                job, reason, command = (line.split("|", 2) + ["", ""])[:3]
                if command.startswith(self.folder) and reason in NEVER_STARTS and job not in self.reasons:
                    self.reasons[job] = reason
                    subprocess.run(["scancel", job], capture_output=True, timeout=30)
                    _thread.interrupt_main()  # submitit may not learn of it (no accounting): stop waiting


class SlurmLauncher(_SubmititSlurmLauncher):  # type: ignore[misc]
    """`conf/hydra/launcher/slurm.yaml`'s launcher: submitit's, with one-line refusals."""

    def _summarise(self, exc: BaseException) -> str:
        """The sweep summary (Hydra's end-of-sweep callbacks do not run after a launcher error)
        and one line on the job that ended without a result (preempted, not requeued, or killed)."""
        from framework.cli import sweep

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep.print_summary(sweep.write_summary(sweep_dir), sweep_dir)
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        return f"a job ended without finishing ({first.strip()}); summary: {sweep_dir / 'summary.json'}"

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        """Submit and wait as submitit's launcher does; what Slurm refuses ends the sweep in one line."""
        from submitit.core.utils import UncompletedJobError

        folder = str(self.params["submitit_folder"]).split("%j")[0]
        watch = _PendingWatch(folder)
        watch.start()
        try:
            return super().launch(job_overrides, initial_job_idx)
        except (Exception, KeyboardInterrupt) as exc:
            if watch.reasons:
                said = ", ".join(f"job {job}: Reason={reason}" for job, reason in watch.reasons.items())
                message = f"Slurm can never start this request ({said}); see `scontrol show partition`"
            elif "sbatch: error" in str(exc):  # submitit raises sbatch's refusal as a job error
                message = _sbatch_message(exc)
            elif isinstance(exc, UncompletedJobError):  # a job ended without a result: not finished
                message = self._summarise(exc)
            else:
                raise
            print(f"Error: {message}", file=sys.stderr)
            raise SystemExit(1) from None
        finally:
            watch.stop.set()
