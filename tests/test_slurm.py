"""Slurm: joining from Slurm's own environment (unit tests, no Slurm needed), the sweep summary's
statuses, and a real Slurm (two `slurmd` on this machine as two nodes; see tests/slurm_cluster.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework import slurm, sweep


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
