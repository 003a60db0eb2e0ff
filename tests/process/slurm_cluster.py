"""A real Slurm on this machine for the tests: Debian's packages (installed with apt-get when
missing), munged, one slurmctld and two slurmd as two nodes (`hs-n1`, `hs-n2`, both 127.0.0.1 on
their own ports), no systemd, no cgroups, no accounting. Started once per test session and
stopped by PID."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
NODES = {"hs-n1": 6821, "hs-n2": 6822}
CTLD_PORT = 6820

CONF = """\
ClusterName=hydraspeed-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again after cred_expire + 1 s (default 120) at the scheduler's next
# pass (default every 60 s): both short here, so a requeue costs seconds.
AuthInfo=cred_expire=5
SchedulerParameters=sched_interval=2,bf_interval=2
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobRequeue=1
ReturnToService=2
KillWait=30
MinJobAge=300
MessageTimeout=30
SlurmdTimeout=300
InactiveLimit=0
MpiDefault=none
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _have_slurm() -> bool:
    return all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "srun", "sbatch", "munged"))


def ensure_installed() -> str | None:
    """Install Slurm from Debian's packages when missing; the reason it cannot run, or None."""
    if _have_slurm():
        return None
    if shutil.which("apt-get") is None:
        return "Slurm is not installed and apt-get is not available to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            return f"`{' '.join(cmd)}` failed: {done.stderr.strip().splitlines()[-1:]}"
    return None if _have_slurm() else "apt-get installed Slurm but its programs are not on PATH"


def _resolvable(names: list[str]) -> None:
    """The node names must resolve (the first one is the master address of an srun step)."""
    hosts = Path("/etc/hosts")
    text = hosts.read_text()
    missing = [n for n in names if n not in text.split()]
    if missing:
        with hosts.open("a") as f:
            f.write(f"127.0.0.1 {' '.join(missing)}\n")


class SlurmCluster:
    """The daemons of a two-node test cluster; `env` is what a client (srun, sbatch) needs."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        self.started = time.time()
        for sub in ("state", *(f"spool-{n}" for n in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(
            f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={name} Port={port} CPUs={os.cpu_count()} State=UNKNOWN"
            for name, port in NODES.items()
        )
        self.conf.write_text(CONF.format(root=self.root, ctld_port=CTLD_PORT, nodes=nodes))
        _resolvable(list(NODES))
        self._start_munge()
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for name in NODES:
            self._spawn(["slurmd", "-D", "-N", name, "-f", str(self.conf)])
        self._wait_idle()

    def _start_munge(self) -> None:
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
            return  # one is already running: credentials work through it
        run_dir = Path("/run/munge")
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(run_dir, "munge", "munge")
        self._spawn(["runuser", "-u", "munge", "--", "munged", "-F"])
        time.sleep(0.5)

    def _spawn(self, cmd: list[str]) -> None:
        log = open(self.root / f"{Path(cmd[0]).name}-{len(self.procs)}.out", "w")  # noqa: SIM115
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def _wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split()
            states = dict(zip(out[::2], out[1::2]))
            if all(states.get(n, "").startswith("idle") for n in NODES):
                return
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout} s: {self.run(['sinfo', '-N']).stdout}")

    def run(self, cmd: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(cmd, env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
                              timeout=timeout, **kw)  # fmt: skip

    def job_state(self, job_id: str) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, CANCELLED, ...) with its exit code."""
        out = self.run(["scontrol", "show", "job", job_id]).stdout
        fields = dict(part.split("=", 1) for part in out.split() if "=" in part)
        return f"{fields.get('JobState', '?')} {fields.get('ExitCode', '?')} restarts={fields.get('Restarts', '?')}"

    def wait_job(self, job_id: str, timeout: float = 180) -> str:
        """Wait until the job is no longer pending or running; its final state."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if not state.startswith(("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUE")):
                return state
            time.sleep(0.5)
        self.run(["scancel", job_id])
        raise AssertionError(f"job {job_id} still {self.job_state(job_id)} after {timeout} s")

    def stop(self) -> None:
        """Cancel what still runs, wait for it to leave, then stop the daemons; job processes
        (slurmstepd and below) that outlived that are killed by PID."""
        with contextlib.suppress(Exception):
            self.run(["scancel", "--full", *self.run(["squeue", "-h", "-o", "%i"]).stdout.split()])
            deadline = time.monotonic() + 30
            while self.run(["squeue", "-h"]).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for proc in psutil.process_iter(["name", "create_time"]):
            if proc.info["name"] == "slurmstepd" and proc.info["create_time"] >= self.started:
                with contextlib.suppress(psutil.Error):
                    for child in [*proc.children(recursive=True), proc]:
                        child.kill()
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
