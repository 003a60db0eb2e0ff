"""Slurm: joining from Slurm's own environment (unit tests, no Slurm needed), the sweep summary's
statuses, and a real Slurm (two `slurmd` on this machine as two nodes; see tests/process/slurm_cluster.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from framework import checkpoint
from framework.cli import sweep
from framework.process import slurm

from ..conftest import FAST, ROOT, final_metrics, popen, run_cmd, subprocess_env
from .slurm_cluster import SlurmCluster, ensure_installed

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[1-2,5],login", ["n1", "n2", "n5", "login"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("a1,b[007-008]x", ["a1", "b007x", "b008x"]),
    ],
)
def test_slurm_node_lists_expand_as_scontrol_show_hostnames_does(nodelist, hosts):
    assert slurm.hostnames(nodelist) == hosts


def test_slurm_task_counts_per_node_expand():
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.tasks_per_node("4") == [4]


STEP = {  # task 3 of `srun --nodes=2 --ntasks=4` in job 4242, on the second node
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_NODELIST": "node[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


def test_an_srun_task_gets_its_rank_and_the_first_node_as_master():
    env = slurm.rendezvous_from_slurm(STEP)
    assert env is not None
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node07",
    }
    # every task derives the same port; another job gets another one; a user's choice wins
    ports = {slurm.rendezvous_from_slurm({**STEP, "SLURM_PROCID": str(r)})["MASTER_PORT"] for r in range(4)}
    assert len(ports) == 1 and 20000 <= int(ports.pop()) < 60000
    assert slurm.rendezvous_from_slurm({**STEP, "SLURM_JOB_ID": "4243"})["MASTER_PORT"] != env["MASTER_PORT"]
    assert slurm.rendezvous_from_slurm({**STEP, "MASTER_PORT": "29555"})["MASTER_PORT"] == "29555"


@pytest.mark.parametrize(
    "env",
    [
        {**STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"},  # one task: trainer.devices=N spawns
        {**STEP, "RANK": "0", "WORLD_SIZE": "8"},  # torchrun (or another launcher) inside the step
        {k: v for k, v in STEP.items() if k not in ("SLURM_STEP_ID",)},  # the batch script, not a step
        {},
    ],
)
def test_no_join_outside_a_multi_task_srun_step(env):
    assert slurm.rendezvous_from_slurm(env) is None


def test_a_requeued_job_is_recognised():
    assert slurm.requeued({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"})
    assert not slurm.requeued({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"})
    assert not slurm.requeued({"SLURM_RESTART_COUNT": "1"})


def _job(root: Path, num: int, status: str | None, step: int, final: bool) -> None:
    job = root / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr={num}\n")
    (job / "metrics.jsonl").write_text(json.dumps({"kind": "step", "step": step}) + "\n")
    if final:
        (job / "final_metrics.json").write_text(json.dumps({"val_loss": 0.5, "step": step}))
    if status:
        sweep.write_status(job, status)


def test_the_sweep_summary_tells_finished_from_preempted_requeued_and_failed(tmp_path):
    _job(tmp_path, 0, "ok", 110, final=True)
    _job(tmp_path, 1, "preempted", 57, final=True)  # a preempted run writes final metrics too
    _job(tmp_path, 2, "requeued", 40, final=True)
    _job(tmp_path, 3, None, 12, final=False)  # died
    rows = sweep.write_summary(tmp_path)
    assert [(r["status"], r["step"]) for r in rows] == [
        ("ok", 110),
        ("preempted", 57),
        ("requeued", 40),
        ("failed", 12),
    ]
    assert json.loads((tmp_path / "summary.json").read_text()) == rows


# --- a real Slurm: two nodes on this machine -------------------------------------------------

SLOW = "+callbacks.slow={_target_:tests.helpers.SlowDown,seconds:0.1}"
ARGS = [*FAST, "trainer.epochs=3", SLOW]  # 66 optimizer steps on 2 ranks, ~7 s of training
TIMING = ("samples_per_s", "tokens_per_s", "mfu")


def _numbers(run_dir: Path) -> dict:
    """final_metrics.json without the measured timings (they differ run to run)."""
    return {k: v for k, v in final_metrics(run_dir).items() if k not in TIMING and not k.startswith("time_")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = ensure_installed()
    if reason:
        print(f"skipping the real-Slurm tests: {reason}")
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def srun(cluster: SlurmCluster, run_dir: Path, *extra: str, timeout: float = 240):
    cmd = ["srun", "--nodes=2", "--ntasks=2", f"--chdir={ROOT}", sys.executable, "train.py"]
    return cluster.run(
        [*cmd, *ARGS, *extra, f"hydra.run.dir={run_dir}"], timeout=timeout, env=subprocess_env()
    )


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`srun --nodes=2 --ntasks=2 python train.py ...` run to the end: the reference."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    return run_dir, srun(cluster, run_dir)


def wait_for_records(run_dir: Path, count: int = 3, timeout: float = 180, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the launcher ended early: {proc.stderr.read()[-3000:]}")
        with contextlib.suppress(FileNotFoundError):
            if len((run_dir / "metrics.jsonl").read_text().splitlines()) >= count:
                return
        time.sleep(0.2)
    raise AssertionError(f"no training records in {run_dir} after {timeout} s")


def only_job(cluster: SlurmCluster) -> str:
    jobs = cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()
    assert len(jobs) == 1, jobs
    return jobs[0]


def reasons(ckpts: Path) -> list[str]:
    return [
        json.loads((p / "COMPLETE.json").read_text())["reason"]
        for p in checkpoint.complete_checkpoints(ckpts)
    ]


@pytest.mark.slow
def test_plain_srun_with_two_tasks_on_two_nodes_forms_one_group(uninterrupted):
    run_dir, run = uninterrupted
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"slurm: 2 tasks of job \d+ joined one group \(srun; .* master hs-n1:\d+\)", run.stdout)
    assert _numbers(run_dir)["step"] == 66  # a global batch of 64 over 2 ranks, 3 epochs
    newest = checkpoint.complete_checkpoints(run_dir / "checkpoints")[-1]
    assert json.loads((newest / "COMPLETE.json").read_text())["dp_size"] == 2
    assert (run_dir / "metrics.jsonl").read_text().count('"kind": "epoch"') == 3  # rank 0 alone wrote


def _signal_a_sweep(cluster, tmp_path, extra: list[str], timeout: float):
    """A one-job sweep on the slurm launcher, sent submitit's time-limit signal (USR2) as soon as
    it logs: (process, job id, stdout, stderr) once the launcher has ended."""
    args = ["-m", "hydra/launcher=slurm", "hydra.launcher.timeout_min=5", *extra, *ARGS]
    proc = popen([sys.executable, str(ROOT / "train.py"), *args, f"hydra.sweep.dir={tmp_path}"],
                 env=subprocess_env(SLURM_CONF=cluster.env["SLURM_CONF"]))  # fmt: skip
    try:
        wait_for_records(tmp_path / "0", proc=proc)
        job = only_job(cluster)
        assert cluster.run(["scancel", "--signal=USR2", job]).returncode == 0
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, job, out, err


@pytest.mark.slow
def test_a_time_limit_signal_under_submitit_saves_requeues_and_finishes_alike(
    cluster, uninterrupted, tmp_path
):
    """The README's sweep on two nodes; Slurm's time-limit warning (submitit asks for USR2, sent
    here at once with scancel --signal) -> checkpoint -> submitit requeues -> the requeued
    attempt resumes by itself -> the same final metrics as the uninterrupted run."""
    proc, job, out, err = _signal_a_sweep(cluster, tmp_path, ["hydra.launcher.nodes=2"], timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "restarts=1" in cluster.wait_job(job)
    assert "preempted" in reasons(tmp_path / "0" / "checkpoints")
    assert _numbers(tmp_path / "0") == _numbers(uninterrupted[0])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(row["status"], row["step"]) for row in summary] == [("ok", 66)]


SBATCH = """#!/bin/bash
#SBATCH --nodes=2 --ntasks=2 --signal=USR1@60 --requeue --output={out}/slurm-%j.out
srun python train.py {args} hydra.run.dir={out}
code=$?
if [ $code -eq 75 ]; then scontrol requeue $SLURM_JOB_ID; fi
exit $code
"""


@pytest.mark.slow
def test_the_readme_sbatch_script_requeues_on_the_time_limit_signal_and_finishes_alike(
    cluster, uninterrupted, tmp_path
):
    """USR1 (what `--signal=USR1@60` sends to the job's tasks before the time limit, sent at once
    here) -> checkpoint -> exit 75 -> the script requeues -> the attempt resumes -> finished."""
    script = tmp_path / "job.sh"
    script.write_text(SBATCH.format(out=tmp_path, args=" ".join(f"'{a}'" for a in ARGS)))
    submitted = cluster.run(["sbatch", "--parsable", f"--chdir={ROOT}", str(script)], env=subprocess_env())
    job = submitted.stdout.strip().split(";")[0]
    assert job.isdigit(), submitted.stderr
    wait_for_records(tmp_path)
    assert cluster.run(["scancel", "--signal=USR1", job]).returncode == 0
    state = cluster.wait_job(job, timeout=300)
    assert state.startswith("COMPLETED 0:0") and "restarts=1" in state, state
    assert "preempted" in reasons(tmp_path / "checkpoints")
    assert _numbers(tmp_path) == _numbers(uninterrupted[0])


@pytest.mark.slow
def test_scancel_saves_a_checkpoint_and_the_run_resumes_to_the_same_result(cluster, uninterrupted, tmp_path):
    command = f"srun python train.py {' '.join(repr(a) for a in ARGS)} hydra.run.dir={tmp_path}"
    submitted = cluster.run(["sbatch", "--parsable", "--nodes=2", "--ntasks=2", f"--chdir={ROOT}",
                             f"--output={tmp_path}/slurm-%j.out", "--wrap", command], env=subprocess_env())  # fmt: skip
    job = submitted.stdout.strip().split(";")[0]
    assert job.isdigit(), submitted.stderr
    wait_for_records(tmp_path)
    assert cluster.run(["scancel", job]).returncode == 0
    assert cluster.wait_job(job).startswith("CANCELLED")
    saved = json.loads((checkpoint.find_resumable(tmp_path / "checkpoints") / "COMPLETE.json").read_text())
    assert saved["reason"] == "preempted" and 0 < saved["step"] < 66
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "preempted"
    resumed = srun(cluster, tmp_path, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _numbers(tmp_path) == _numbers(uninterrupted[0])


@pytest.mark.slow
def test_what_slurm_refuses_is_one_line_not_a_traceback_or_a_silent_wait(cluster, tmp_path):
    def sweep(*extra: str):
        args = [
            "-m",
            "hydra/launcher=slurm",
            *FAST,
            *extra,
            f"hydra.sweep.dir={tmp_path / str(len(extra[0]))}",
        ]
        return run_cmd([sys.executable, str(ROOT / "train.py"), *args], timeout=90,
                       env=subprocess_env(SLURM_CONF=cluster.env["SLURM_CONF"]))  # fmt: skip

    gpus = sweep("trainer.accelerator=cuda")  # a GPU request on a cluster without GPUs: sbatch refuses
    assert gpus.returncode == 1 and "Traceback" not in gpus.stderr
    assert "Error: sbatch: error: Invalid generic resource (gres) specification" in gpus.stderr
    cpus = sweep("hydra.launcher.cpus_per_task=64")  # accepted, but would stay PENDING forever
    assert cpus.returncode == 1 and "Traceback" not in cpus.stderr
    assert re.search(
        r"Error: Slurm can never start this request \(job \d+: Reason=PartitionConfig\)", cpus.stderr
    )
    assert (
        "PartitionConfig" not in cluster.run(["squeue", "-h", "-o", "%r"]).stdout
    )  # cancelled, not left pending


@pytest.mark.slow
def test_a_preempted_job_submitit_does_not_requeue_is_summarised_preempted_and_fails_the_sweep(
    cluster, tmp_path
):
    """max_num_timeout=0: submitit declines the requeue after a time limit. The job saved; the
    summary says `preempted` at the step reached (not `ok`), and the sweep exits non-zero."""
    proc, job, out, err = _signal_a_sweep(
        cluster, tmp_path, ["hydra.launcher.max_num_timeout=0"], timeout=180
    )
    cluster.wait_job(job)
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    [row] = json.loads((tmp_path / "summary.json").read_text())
    assert row["status"] == "preempted" and 0 < row["step"] < 66
    assert f"1 job(s) did not finish: 0 ({row['overrides']}): preempted at step {row['step']}" in out
    assert (
        json.loads((checkpoint.find_resumable(tmp_path / "0" / "checkpoints") / "COMPLETE.json").read_text())[
            "step"
        ]
        == row["step"]
    )
