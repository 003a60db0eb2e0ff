"""Slurm's own environment: the tasks of an `srun` step join one process group, and a requeued
job knows it is one.

Under `srun --ntasks=N python train.py ...` every task is one rank. Slurm tells each task who it
is (SLURM_PROCID, SLURM_LOCALID, the step's task and node lists); torch wants RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT. `rendezvous_from_slurm` translates, as Lightning's
`SLURMEnvironment` does: the master is the first host of the step's node list and the port is
derived from the job and step ids, so every task computes the same address without talking.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping

_RANGE = re.compile(r"\[([^\]]*)\]")


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: `n[1-3,5],gpu1` -> ['n[1-3,5]', 'gpu1']."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand(pattern: str) -> Iterator[str]:
    """One host pattern with zero or more bracket groups, e.g. `rack[1-2]-n[08-10]`."""
    match = _RANGE.search(pattern)
    if match is None:
        yield pattern
        return
    head, tail = pattern[: match.start()], pattern[match.end() :]
    for item in match.group(1).split(","):
        low, _, high = item.partition("-")
        width = len(low)  # zero padding is kept: n[08-10] -> n08 n09 n10
        for number in range(int(low), int(high or low) + 1):
            for rest in _expand(tail):
                yield f"{head}{number:0{width}d}{rest}"


def hostnames(nodelist: str) -> list[str]:
    """Slurm's compressed node list (`n[1-3,5],login[01-02]`) as host names, in order (what
    `scontrol show hostnames` prints)."""
    return [host for part in _split_top(nodelist.strip()) for host in _expand(part)]


def tasks_per_node(spec: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE (`2(x3),1`) as one count per node: [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise ValueError(f"cannot read the task counts {spec!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def master_port(job_id: str, step_id: str = "0") -> int:
    """A port every task of the step derives alike without talking, in 20000-59999. A port
    already taken fails at the rendezvous, naming it; MASTER_PORT in the environment wins."""
    step = int(step_id) if step_id.isdigit() else 0
    return 20000 + (int(job_id) * 17 + step) % 40000


def step_task_count(env: Mapping[str, str]) -> int:
    """Tasks in this srun step (1 outside one; the batch script itself is not an srun step)."""
    if "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
        return 1
    return int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1)


def rendezvous_from_slurm(env: Mapping[str, str]) -> dict[str, str] | None:
    """The torch rendezvous variables for one task of a multi-task srun step, or None when this
    process is not one (no srun step, a single task, or a launcher already set ranks).
    MASTER_ADDR/MASTER_PORT already in the environment are kept (a user's choice)."""
    launched = "RANK" in env and "WORLD_SIZE" in env
    if launched or step_task_count(env) <= 1 or "SLURM_PROCID" not in env:
        return None
    nodes = hostnames(env.get("SLURM_STEP_NODELIST") or env["SLURM_NODELIST"])
    counts = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1"))
    node = int(env.get("SLURM_NODEID", "0"))
    step_id = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "0"
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": str(step_task_count(env)),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(counts[node] if node < len(counts) else counts[-1]),
        "MASTER_ADDR": env.get("MASTER_ADDR") or nodes[0],
        "MASTER_PORT": env.get("MASTER_PORT") or str(master_port(env["SLURM_JOB_ID"], step_id)),
    }


def under_submitit(env: Mapping[str, str] | None = None) -> bool:
    """True inside a job started by submitit (Hydra's submitit launcher)."""
    return "SUBMITIT_FOLDER" in (os.environ if env is None else env)


def requeued(env: Mapping[str, str] | None = None) -> bool:
    """True in a Slurm job that was requeued (`scontrol requeue`, a preemption, submitit's
    requeue after a time-limit signal): its earlier attempt's checkpoint is the place to go on."""
    env = os.environ if env is None else env
    return "SLURM_JOB_ID" in env and int(env.get("SLURM_RESTART_COUNT", "0") or 0) > 0


def gpus_per_node(accelerator: str, devices: int, partition: str | None = None) -> int | None:
    """GPUs to request per node for a run (`conf/hydra/launcher/slurm.yaml`): `trainer.devices`
    when the run trains on GPUs (accelerator cuda, or auto on a cluster whose nodes have GPUs, as
    `sinfo` lists their generic resources), None (no --gpus-per-node) otherwise: a CPU cluster
    rejects any GPU request ("Invalid generic resource (gres) specification")."""
    if accelerator == "cpu":
        return None
    if accelerator == "cuda" or shutil.which("sinfo") is None:
        return devices
    cmd = ["sinfo", "-h", "-o", "%G", *(["-p", partition] if partition else [])]
    listed = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    return devices if "gpu" in listed.lower() else None
