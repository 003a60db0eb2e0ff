"""Preemption signals wherever they land: TERM, USR1 and USR2, sent to the launcher of a
`trainer.devices=N` run, to its workers only, or to a single process, save a checkpoint at the
next step boundary and end the job within seconds with the documented exit code."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from framework import checkpoint
from framework.checkpoint import preemption
from framework.checkpoint.preemption import EXIT_PREEMPTED

from ..conftest import FAST, ROOT, popen, run_cmd, torchrun

pytestmark = pytest.mark.timeout(300)

SLOW = "+callbacks.slow={_target_:tests.helpers.SlowDown,seconds:0.08}"


def start(args: list[str], run_dir: Path) -> subprocess.Popen:
    return popen([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"])


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, count: int = 3, timeout: float = 120) -> None:
    """Until the run logged `count` records (it is training, its handlers are installed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        try:
            if len((run_dir / "metrics.jsonl").read_text().splitlines()) >= count:
                return
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise AssertionError("the run logged nothing in time")


def workers_of(pid: int) -> list[psutil.Process]:
    children = psutil.Process(pid).children()
    return [c for c in children if not any("resource_tracker" in part for part in c.cmdline())]


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The run's output once it ended; a run still going after `timeout` is killed and fails the test."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"the job did not end within {timeout} s of the signal:\n{err[-3000:]}"
        ) from None


@pytest.mark.parametrize(
    ("signum", "target", "devices"),
    [
        (signal.SIGTERM, "workers", 2),  # a pod's or a process group's signal: not the launcher
        (signal.SIGUSR1, "launcher", 2),  # sbatch --signal=USR1@60 to a one-task step
        (signal.SIGUSR2, "launcher", 1),  # submitit's time-limit signal, one process
    ],
)
@pytest.mark.slow
def test_a_preemption_signal_saves_and_ends_the_job_with_the_preempted_exit_code(
    tmp_path, signum, target, devices
):
    args = [*FAST, "trainer.epochs=5", SLOW, f"trainer.devices={devices}", "trainer.checkpoint.grace_s=30"]
    proc = start(args, tmp_path)
    wait_for_steps(proc, tmp_path)
    signalled = time.monotonic()
    if target == "workers":
        workers = workers_of(proc.pid)
        assert len(workers) == devices
        for worker in workers:
            worker.send_signal(signum)
    else:
        proc.send_signal(signum)
    out, err = finish(proc, timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert time.monotonic() - signalled < 30
    assert f"preempted ({signal.Signals(signum).name}): checkpoint saved at step" in out
    took = re.search(r"saved at step \d+ (\d+\.\d) s after the signal, (-?\d+\.\d) s before grace_s=30", out)
    assert took and float(took[1]) < 5 and float(took[2]) > 25, out[-2000:]  # the measured margin
    saved = checkpoint.find_resumable(tmp_path / "checkpoints")
    meta = json.loads((saved / "COMPLETE.json").read_text())
    assert meta["reason"] == "preempted" and 0 < meta["step"] < 110
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "preempted"


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_ctrl_c_ends_the_job_with_130_naming_its_last_checkpoint(tmp_path, devices):
    """SIGINT is not preemption: the job ends at once, 128 + 2, in one line naming the last checkpoint
    and how to go on (one process: no KeyboardInterrupt traceback; two: the launcher passes it on,
    and a worker interrupted inside torch's process wrapper would otherwise exit 0 with no result
    and leave the launcher waiting for one)."""
    args = [*FAST, "trainer.epochs=5", SLOW, f"trainer.devices={devices}", "trainer.checkpoint.save_freq=5"]
    proc = start(args, tmp_path)
    wait_for_steps(proc, tmp_path)
    signalled = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the launcher and its workers
    _, err = finish(proc, timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert time.monotonic() - signalled < 30
    assert re.search(
        rf"interrupted \(SIGINT\); last checkpoint: {tmp_path}/checkpoints/step_\d+ \(step \d+\); resume with "
        rf"trainer.resume=auto trainer.checkpoint.dir={tmp_path}/checkpoints",
        err,
    ), err[-3000:]
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_sigterm_after_the_final_checkpoint_ends_a_finished_run_with_0(tmp_path, devices):
    """A SIGTERM 0.3-0.8 s after a run finished (its final checkpoint complete) killed the exiting
    process (Python gives the default action back on its way out) or a worker, and the job ended
    by SIGTERM or without its status. Here SIGTERM every 0.1 s from the final checkpoint until the
    job is gone, so one lands while it exits: 0, as the docs promise, with its status."""
    proc = start([*FAST, f"trainer.devices={devices}"], tmp_path)

    def finished() -> bool:
        ends = [p / "COMPLETE.json" for p in (tmp_path / "checkpoints").glob("step_*")]
        return any(f.is_file() and json.loads(f.read_text())["reason"] == "end" for f in ends)

    deadline = time.monotonic() + 120
    while not finished():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.02)
    sent = 0
    while proc.poll() is None and sent < 300:
        proc.send_signal(signal.SIGTERM)
        sent += 1
        time.sleep(0.1)
    _, err = finish(proc, timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "ok"
    assert "Error" not in err and sent >= 1


@pytest.mark.slow
def test_the_checkpoint_comes_within_one_step_of_the_signal_whatever_the_step_time(tmp_path):
    """Two ranks, a request on rank 1 in the middle of step 3: with steps of 0.3 s both agree at
    the end of step 3 (the agreement waits for its all-reduce at such steps); with steps of
    20 ms, which an all-reduce each would slow, both agree at the same step within ~0.75 s."""
    script = str(ROOT / "tests" / "scripts" / "preemption_agreement.py")
    run = run_cmd([*torchrun(2), script, str(tmp_path), "0.3", "0.02"], timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["0.3"]["step"] == ranks[1]["0.3"]["step"] == 3, ranks
    assert ranks[0]["0.02"]["step"] == ranks[1]["0.02"]["step"], ranks
    assert max(r["0.02"]["after_s"] for r in ranks) < 1.0, ranks


def test_a_step_and_a_save_longer_than_the_grace_time_are_said_once():
    deadline = preemption.Deadline(grace_s=1.0)
    deadline.step_ended()
    time.sleep(0.3)
    deadline.step_ended()  # a step of 0.3 s
    assert deadline.late() is None  # no save measured yet
    deadline.saved(0.5)
    assert deadline.late() is None  # 0.8 s fits in 1 s
    deadline.saved(0.9)
    late = deadline.late()
    assert late is not None and "needs ~1.2 s" in late and "trainer.checkpoint.grace_s=1" in late
    assert "\n" not in late and deadline.late() is None  # said once
    assert preemption.Deadline(grace_s=None).late() is None
