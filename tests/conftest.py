"""Shared test helpers: compose the real conf/, shrink it for CPU, run train.py as a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Keep two processes on two cores from oversubscribing, and wandb off the network.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
# The suite is the CPU smoke test (what CI runs): on a GPU machine the GPUs are hidden, so two
# ranks never compete for one GPU under nccl. The CUDA path is checked by benchmarks.gpu_check.
if os.environ.get("HYDRASPEED_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# A small, fast run of the real config (the data and model are the shipped defaults).
FAST = ["trainer.epochs=1", "trainer.log_freq=5", "trainer.batch_size=64"]


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child run: no launcher variables leaking in from this process."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", WANDB_MODE=env.get("WANDB_MODE", "disabled"), PYTHONUNBUFFERED="1")
    # `tests.helpers` importable from any child (a script under tests/scripts puts its own folder
    # first on sys.path, not the repo root).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def popen(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    """Start a command from the repo root in its own process group (so a launcher and its workers
    can be killed together), output captured as text."""
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env or subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run_cmd(cmd: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command in its own process group; on timeout kill the whole group (launcher and
    workers), so a hung multi-process run never outlives its test."""
    proc = popen(cmd, env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(nproc: int) -> list[str]:
    """The command prefix that starts `nproc` local workers with torch's elastic launcher."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def run_layout_script(
    out: Path, *args: str, ranks: int = 2, timeout: float = 280, env: dict | None = None,
    script: str = "layout_invariance.py",
):  # fmt: skip
    """Run `tests/scripts/layout_invariance.py OUT ARGS` (one SGD step under a layout against one
    process; or another `script` of tests/scripts writing the same files) on `ranks` workers; each
    rank's results ({"errors", "shares", ...}), after checking that no case of any rank is off by
    more than 1e-5."""
    script = str(ROOT / "tests" / "scripts" / script)
    run = run_cmd([*torchrun(ranks), script, str(out), *args], timeout, env)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    for result in results:
        bad = {case: e for case, e in result["errors"].items() if max(e) > 1e-5}
        assert not bad, bad
    return results


def run_train(args: list[str], run_dir: Path, timeout: float = 240, nproc: int = 0, env: dict | None = None):
    """Run `python train.py ARGS hydra.run.dir=RUN_DIR` (under torchrun when nproc > 0)."""
    cmd = torchrun(nproc) if nproc else [sys.executable]
    cmd += [str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"]
    return run_cmd(cmd, timeout, env)


@contextlib.contextmanager
def train_aside(args: list[str], run_dir: Path, timeout: float = 240) -> Iterator[Future]:
    """`run_train` in a thread while the block runs (the uninterrupted twin of a run the block
    kills: each is mostly start-up on 2 cores); the block's end waits for it."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(run_train, args, run_dir, timeout)


def fails_cleanly(run: subprocess.CompletedProcess, *words: str) -> None:
    """A non-zero exit whose output holds every one of `words`, and no traceback."""
    assert run.returncode != 0
    text = run.stdout + run.stderr
    for word in words:
        assert word in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def final_metrics(run_dir: Path) -> dict:
    """The final_metrics.json a run wrote."""
    return json.loads((run_dir / "final_metrics.json").read_text())


# What a launcher sets: a process context sets them for a launcher-less process (and removes them
# when it closes); none of them may outlive a test, or later runs would think they were launched.
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_AT_START = {key: os.environ.get(key) for key in LAUNCHER_VARIABLES}


def end_group() -> None:
    """End this test process's default process group, whichever context made it, with
    DeepSpeed's cached groups (a test that builds several engines wants each on a fresh group),
    and the launcher variables the suite did not start with."""
    import torch.distributed as dist

    from framework.backend import deepspeed_globals

    if dist.is_initialized():
        dist.destroy_process_group()
    deepspeed_globals.forget_groups()
    for key, value in _AT_START.items():
        if value is None:
            os.environ.pop(key, None)


@pytest.fixture(autouse=True)
def _one_group_per_test():
    """Every in-process test starts without a process group and leaves none behind, with the
    environment it found (a context's rendezvous variables, LOCAL_SIZE, DS_ACCELERATOR)."""
    before = dict(os.environ)
    yield
    end_group()
    for key in set(os.environ) - set(before):
        del os.environ[key]
    os.environ.update(before)


@pytest.fixture
def compose():
    """Compose conf/train.yaml with overrides (normalised like the CLI), as Hydra would for train.py."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from framework.cli.argv import normalize
    from framework.cli.config import GROUPS, register_configs

    register_configs()

    def _compose(overrides: list[str] | None = None):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose(config_name="train", overrides=normalize(list(overrides or []), set(GROUPS)))

    return _compose
