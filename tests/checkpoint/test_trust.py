"""Trust: a checkpoint never runs code, corruption is caught, a NaN never reaches a checkpoint,
one run per checkpoint dir, a different setup is named, and values that would crash mid-run are
refused before it starts. In-process where the behaviour allows it (fast); the launcher and
filesystem faults run the real thing as subprocesses."""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from framework import CheckpointError, ConfigError, Engine, NonFiniteLoss, Strategy, checkpoint
from framework.checkpoint import safety, store
from framework.data.datasets import csv_classification, synthetic
from framework.export import fp32_state_dict
from framework.models import MLP

from ..conftest import (
    FAST,
    ROOT,
    end_group,
    fails_cleanly,
    final_metrics,
    popen,
    run_cmd,
    run_train,
    subprocess_env,
)

pytestmark = pytest.mark.timeout(300)


def engine(stage: int = 0, optimizer=torch.optim.AdamW, lr: float = 1e-2, **kwargs) -> Engine:
    torch.manual_seed(0)
    return Engine(
        MLP(hidden=[32]),
        torch.nn.CrossEntropyLoss(),
        functools.partial(optimizer, lr=lr),
        strategy=Strategy(sharding={"stage": stage}),
        **kwargs,
    )


DATA = synthetic(num_samples=512)


def trained(tmp_path: Path, stage: int = 1, save_freq: int = 0) -> Path:
    """A checkpoints dir with real DeepSpeed checkpoints (ZeRO-`stage`, 1 process)."""
    engine(stage).fit(DATA.train, epochs=1, batch_size=32, save_dir=str(tmp_path), save_freq=save_freq)
    end_group()
    return tmp_path


def rewrite_checksums(path: Path) -> None:
    """What someone who plants a file would do: make COMPLETE.json's checksums match again."""
    meta = json.loads((path / store.COMPLETE).read_text())
    meta["files"] = safety.digests(path)
    (path / store.COMPLETE).write_text(json.dumps(meta))


class Payload:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


# ------------------------------------------------------------------------------------- 1. no code runs


@pytest.mark.slow
def test_a_checkpoint_that_would_run_code_is_refused_by_resume_and_export(tmp_path):
    ckpts = trained(tmp_path / "ckpts")
    path = store.find_resumable(ckpts)
    marker = tmp_path / "marker"
    target = path / "mp_rank_00_model_states.pt"
    state = torch.load(target, weights_only=False)
    state["extra"] = Payload(marker)
    torch.save(state, target)
    rewrite_checksums(path)  # the checksums alone would not stop it
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt would run code when loaded"):
        engine(1).fit(DATA.train, epochs=2, batch_size=32, resume=str(path))
    with pytest.raises(CheckpointError, match="would run code"):
        fp32_state_dict(path)  # export (DeepSpeed's zero_to_fp32 behind it)
    export = run_cmd([sys.executable, "-m", "framework.export", str(path), str(tmp_path / "w.safetensors")])
    assert export.returncode != 0 and "would run code" in export.stderr and "Traceback" not in export.stderr
    assert not marker.exists()


def test_a_symbolic_link_in_a_checkpoint_is_refused(tmp_path):
    # A linked directory is not walked by a glob: a poisoned file behind it would reach DeepSpeed.
    path = store.find_resumable(trained(tmp_path / "ckpts"))
    marker, elsewhere = tmp_path / "marker", tmp_path / "elsewhere"
    elsewhere.mkdir()
    torch.save({"x": Payload(marker)}, elsewhere / "fp32.pt")
    (path / "zero").symlink_to(elsewhere, target_is_directory=True)
    # what someone planting it would do (digests() itself refuses links): record its checksum
    meta = json.loads((path / store.COMPLETE).read_text())
    meta["files"]["zero/fp32.pt"] = safety.sha256(elsewhere / "fp32.pt")
    (path / store.COMPLETE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="zero is a symbolic link; refusing to load it"):
        store.verify(path)
    assert not marker.exists()


def test_converting_for_another_world_size_never_reads_files_planted_in_its_output(tmp_path):
    # DeepSpeed's ds_to_universal unpickles every <out>/tmp/<param>/<tp>/<state>.* it finds.
    path = store.find_resumable(trained(tmp_path / "ckpts", stage=2))
    marker = tmp_path / "marker"
    planted = path.with_name(path.name + "_universal") / "tmp" / "features.0.bias" / "0"
    planted.mkdir(parents=True)
    torch.save(Payload(marker), planted / "fp32.07")
    out = store.to_universal(path)
    assert not marker.exists() and not (out / "tmp").exists()
    assert store.read_meta(out)["converted_from"] == safety.sha256(path / store.COMPLETE)
    assert [p.name for p in out.parent.iterdir() if ".converting-" in p.name] == []


# ------------------------------------------------------------------------------------- 3. corruption


def flip_bytes(file: Path, count: int = 16) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2  # inside the tensor data, not the zip directory
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def test_flipped_bytes_are_caught_and_auto_resume_falls_back_to_an_intact_checkpoint(tmp_path, capfd):
    ckpts = trained(tmp_path, stage=0, save_freq=5)  # 13 steps: saved at 5, 10 and the end (3 kept)
    newest = store.find_resumable(ckpts)
    flip_bytes(newest / "mp_rank_00_model_states.pt")  # after find_resumable verified it: checked again
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt is not the file that was saved"):
        fp32_state_dict(newest)
    fallback = store.find_resumable(ckpts)
    assert fallback is not None and fallback != newest and store.step_of(fallback) < store.step_of(newest)
    assert f"skipping checkpoint {newest} is damaged" in capfd.readouterr().err
    resumed = engine(0)
    resumed.fit(DATA.train, epochs=1, batch_size=32, save_dir=str(ckpts), resume="auto")
    assert resumed.state.info.resumed_from == str(fallback)


def test_a_damaged_rank_file_message_is_ours_alone(tmp_path):
    path = store.find_resumable(trained(tmp_path, stage=0))
    rank_file = store.rank_file(path, 0)
    rank_file.write_bytes(rank_file.read_bytes()[:200])
    rewrite_checksums(path)
    with pytest.raises(CheckpointError) as err:
        engine(0).fit(DATA.train, epochs=2, batch_size=32, resume=str(path))
    assert "is damaged" in str(err.value) and "hydraspeed_rank00000.pt" in str(err.value)
    assert "weights_only" not in str(err.value)


# ------------------------------------------------------------------------------------- 5. NaN


def test_after_a_nan_the_named_checkpoint_gives_a_finite_loss_and_auto_resume_skips_the_rest(tmp_path):
    """lr=1e8 with a checkpoint every step: the checkpoint the error names is one whose weights
    give a finite loss; the ones after it are marked, so resume=auto does not pick them."""
    run = engine(0, optimizer=torch.optim.SGD, lr=1e8)
    with pytest.raises(NonFiniteLoss) as err:
        run.fit(DATA.train, epochs=3, batch_size=32, save_dir=str(tmp_path), save_freq=1, log_freq=1)
    named = str(err.value).split("last good checkpoint: ")[1].split(". ")[0]
    x = torch.stack([DATA.train[i][0] for i in range(len(DATA.train))])
    y = torch.stack([DATA.train[i][1] for i in range(len(DATA.train))])
    if named != "none":
        model = MLP(hidden=[32])
        model.load_state_dict(fp32_state_dict(named))
        with torch.no_grad():
            assert math.isfinite(float(torch.nn.functional.cross_entropy(model(x), y)))
    chosen = store.find_resumable(tmp_path)
    assert (str(chosen) if chosen else "none") == named
    assert all(
        (Path(p) / store.BAD).exists() for p in map(str, store.complete_checkpoints(tmp_path)) if p > named
    )


# ------------------------------------------------------------------------------------- 6. one run per dir


@pytest.mark.slow
def test_a_checkpoint_dir_in_use_by_a_live_run_is_refused_and_a_stale_lock_is_taken(tmp_path):
    lock = tmp_path / store.LOCK
    tmp_path.mkdir(exist_ok=True)
    lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "time": time.time()}))
    with pytest.raises(ConfigError, match=r"is in use by another run \(pid \d+ on "):
        engine().fit(DATA.train, epochs=1, batch_size=32, save_dir=str(tmp_path))
    end_group()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "time": time.time()}))
    engine().fit(DATA.train, epochs=1, batch_size=32, save_dir=str(tmp_path))  # the holder is gone
    assert not lock.exists() and store.complete_checkpoints(tmp_path)


def _race_for_the_lock(ckpt_dir: str, start, results, hold) -> None:
    start.wait()
    try:
        store.acquire_lock(Path(ckpt_dir))
        results.put("took it")
    except ConfigError:
        results.put("refused")
    hold.wait()  # keep it until both have answered


def test_two_runs_starting_together_cannot_both_take_the_lock(tmp_path):
    import multiprocessing

    # not "fork": a child forked from this process (which earlier tests left with threads) can
    # crash before it runs (a segfault in its first garbage collection was seen); the fork server
    # is a fresh process, and its children fork from it with this module already imported
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    for attempt in range(10):
        start, hold, results = context.Barrier(2), context.Event(), context.Queue()
        ckpt_dir = str(tmp_path / str(attempt))
        runs = [
            context.Process(target=_race_for_the_lock, args=(ckpt_dir, start, results, hold))
            for _ in range(2)
        ]
        for run in runs:
            run.start()
        answers = sorted(results.get(timeout=60) for _ in runs)
        hold.set()
        for run in runs:
            run.join(timeout=60)
        assert answers == ["refused", "took it"], f"attempt {attempt}: {answers}"


# ------------------------------------------------------------------------------------- 9. another setup


def test_resuming_with_another_stage_or_optimizer_names_the_difference(tmp_path):
    path = store.find_resumable(trained(tmp_path, stage=0))
    with pytest.raises(CheckpointError, match="saved with ZeRO stage 0 .* this run uses ZeRO stage 3") as err:
        engine(3).fit(DATA.train, epochs=2, batch_size=32, resume=str(path))
    assert "python -m framework.export" in str(err.value)
    end_group()
    with pytest.raises(CheckpointError, match="holds AdamW optimizer states; this run uses SGD"):
        engine(0, optimizer=torch.optim.SGD).fit(DATA.train, epochs=2, batch_size=32, resume=str(path))


def test_engine_load_reads_zero_partitions_of_another_data_parallel_size(tmp_path):
    path = store.find_resumable(trained(tmp_path / "ckpts", stage=2))
    meta = json.loads((path / store.COMPLETE).read_text())
    meta.update(dp_size=2, world_size=2)  # as if saved by 2 ranks: partitions that must be regrouped
    (path / store.COMPLETE).write_text(json.dumps(meta))
    run = engine(2)
    run.load(str(path))  # builds DeepSpeed to read the universal format, converting first
    loaded, saved = run.runtime.full_state_dict(), fp32_state_dict(path)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    end_group()
    built = engine(2)
    built.prepare("train", 32)
    with pytest.raises(
        CheckpointError, match="partitions for 2 data-parallel ranks and this engine was already built"
    ):
        built.load(str(path))


def _zero12_file(path: Path, state: dict) -> None:
    """A ZeRO-1/2 optimizer file as DeepSpeed lays it out (one group), with `state` as its state."""
    fp32 = torch.arange(6.0)
    zero = {"base_optimizer_state": {"state": {0: state} if state else {}, "param_groups": [{"lr": 0.1}]}}
    zero["single_partition_of_fp32_groups"] = [fp32]
    torch.save({"optimizer_state_dict": zero}, path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"module": {"w": fp32}}, path / "mp_rank_00_model_states.pt")


def test_optimizer_states_reach_deepspeeds_converter_under_adams_names_and_come_back(tmp_path):
    """DeepSpeed's converter reads `exp_avg`/`exp_avg_sq` only: SGD's momentum goes under Adam's
    name (zeros for the other, a step) and is renamed back after loading; Adam's pass untouched;
    three states (Adam with amsgrad) cannot be carried, said in one line."""
    from framework.backend import checkpoint_files

    for name, state in {"sgd": {"momentum_buffer": torch.ones(6)}, "adam": {"step": torch.tensor(3.0),
                        "exp_avg": torch.ones(6), "exp_avg_sq": torch.ones(6)}, "amsgrad": {
                        "exp_avg": torch.ones(6), "exp_avg_sq": torch.ones(6), "max_exp_avg_sq": torch.ones(6)}}.items():  # fmt: skip
        (tmp_path / name).mkdir()
        _zero12_file(tmp_path / name, state)
    staged = checkpoint_files.adam_shaped(tmp_path / "sgd", tmp_path / "staged")
    assert staged == {"names": {"exp_avg": "momentum_buffer"}, "step": False}
    saved = torch.load(tmp_path / "staged" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    adam = saved["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
    assert torch.equal(adam["exp_avg"], torch.ones(6)) and not adam["exp_avg_sq"].any() and "step" in adam
    assert (tmp_path / "staged" / "mp_rank_00_model_states.pt").is_file()
    assert checkpoint_files.adam_shaped(tmp_path / "adam", tmp_path / "unused") is None
    with pytest.raises(CheckpointError, match="holds 3 optimizer states per parameter .*max_exp_avg_sq"):
        checkpoint_files.adam_shaped(tmp_path / "amsgrad", tmp_path / "unused")

    param = torch.nn.Parameter(torch.zeros(6))
    sgd = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    sgd.state[param].update(step=torch.tensor(0.0), exp_avg=torch.ones(6), exp_avg_sq=torch.zeros(6))
    checkpoint_files.restore_state_names(sgd, staged)
    assert list(sgd.state[param]) == ["momentum_buffer"]


# ------------------------------------------------------------------------------------- 7, 11. messages


@pytest.mark.parametrize(
    "override, words",
    [
        ("trainer.valid_freq=0", "trainer.valid_freq=0: must be a finite number >= 1"),
        (
            "trainer.checkpoint.keep_last_k=-1",
            "trainer.checkpoint.keep_last_k=-1: must be a finite number >= 0",
        ),
        ("trainer.timeout_s=0", "trainer.timeout_s=0.0: must be a finite number >= 5"),
    ],
)
def test_values_that_would_crash_mid_run_are_refused_at_composition(compose, override, words):
    from framework.recipe import tree_of

    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        tree_of(compose([override]))


def test_a_loss_that_is_not_a_scalar_says_how_to_fix_it():
    run = Engine(
        MLP(hidden=[32]),
        torch.nn.CrossEntropyLoss(reduction="none"),
        functools.partial(torch.optim.SGD, lr=0.1),
    )
    with pytest.raises(
        ConfigError, match=r"the loss must be a scalar, got a tensor of shape \(32,\).*reduction='mean'"
    ):
        run.fit(DATA.train, epochs=1, batch_size=32)


def test_a_model_without_parameters_is_named():
    with pytest.raises(ConfigError, match="Flatten has no trainable parameters"):
        Engine(torch.nn.Flatten(), torch.nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.1)).prepare(
            "train", 8
        )


@pytest.mark.parametrize(
    "text, words",
    [
        ("a,b,label\n1,2,0\n3,x,1\n", "row 3, column 'b': 'x' is not a number"),
        ("a,b,label\n1,2,0\n3,1\n", "row 3: 2 fields where the header has 3"),
        ("a,b,label\n1,2,0\n3,1,1,9\n", "row 3: 4 fields where the header has 3"),
        ("a,b,label\n1,2,0.5\n", "row 2, column 'label': '0.5' is not an integer class id"),
    ],
)
def test_a_bad_csv_names_file_row_and_column(tmp_path, text, words):
    file = tmp_path / "table.csv"
    file.write_text(text)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        csv_classification(str(file))


def test_keep_best_writes_only_inside_the_run_dir():
    from framework import KeepBest

    with pytest.raises(ConfigError, match="must be a plain file name"):
        KeepBest(filename="../../x.safetensors")


def test_export_of_a_missing_checkpoint_names_its_own_argument(tmp_path, capsys):
    from framework.export import main

    (tmp_path / "empty").mkdir()
    for given, words in (
        (tmp_path / "nope", "no such checkpoint"),
        (tmp_path / "empty", "no complete checkpoint"),
    ):
        assert main([str(given), str(tmp_path / "w.safetensors")]) == 1
        err = capsys.readouterr().err.strip()
        assert err == f"Error: checkpoint {given}: {words}" + (
            " in that dir" if "complete" in words else ""
        ), err


# ------------------------------------------------------------------------------------- CLI: one line each


@pytest.mark.parametrize(
    "args, words",
    [
        (["optimizer.lr=nan"], ["optimizer.lr=nan: must be a finite number > 0"]),
        (["model.in_features=abc"], ["model.in_features=abc: MLP takes an integer for in_features"]),
    ],
)
@pytest.mark.slow
def test_bad_values_are_one_line_errors(tmp_path, args, words):
    fails_cleanly(run_train([*args, *FAST], tmp_path), *words)


@pytest.mark.slow
def test_resume_auto_says_when_there_is_nothing_to_resume(tmp_path):
    run = run_train([*FAST, "trainer.epochs=1", "trainer.max_steps=2", "trainer.resume=auto"], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (
        "resume=auto: no complete checkpoint in" in run.stderr and "starting from the beginning" in run.stderr
    )


# ------------------------------------------------------------------------------------- 8. disk full


def _can_mount_tmpfs(where: Path) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k none {where}"], capture_output=True
    )
    return probe.returncode == 0


@pytest.mark.slow
def test_disk_full_names_the_space_and_keeps_the_last_checkpoint(tmp_path):
    """The checkpoint dir on a 400 KiB filesystem: the first checkpoint fits, the second does not."""
    ckpt = tmp_path / "small"
    if shutil.which("unshare") is None or not _can_mount_tmpfs(ckpt):
        pytest.skip("cannot mount a small filesystem here (needs unshare -rm)")
    args = [
        *FAST,
        "trainer.checkpoint.save_freq=5",
        "trainer.checkpoint.keep_last_k=0",
        f"trainer.checkpoint.dir={ckpt}",
    ]
    train = " ".join([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={tmp_path / 'run'}"])
    script = f"mount -t tmpfs -o size=400k none {ckpt} && {train}; echo exit=$?; ls {ckpt}"
    run = run_cmd(["unshare", "-rm", "sh", "-c", script], timeout=240)
    text = run.stdout + run.stderr
    assert "exit=1" in run.stdout, text[-3000:]
    assert f"no space left in {ckpt} to save step_00000010" in text and " MiB free)" in text, text[-3000:]
    assert "last good checkpoint:" in text and "step_00000005" in text
    assert "Traceback" not in text
    listed = run.stdout.split("exit=1")[-1].split()
    assert "step_00000005" in listed and "step_00000010" not in listed  # the partial save was removed


# ------------------------------------------------------------------------------------- 2, 4, 10, 11: processes


@pytest.mark.slow
def test_the_python_api_under_torchrun_exits_zero_without_explicit_teardown(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(
        "import functools, torch\n"
        "from framework import Engine, Strategy\n"
        "from framework.data.datasets import synthetic\n"
        "from framework.models import MLP\n"
        "data = synthetic(num_samples=256)\n"
        "engine = Engine(MLP(hidden=[16]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),\n"
        "                strategy=Strategy(sharding={'stage': 3}))\n"
        "print('final loss', engine.fit(data.train, epochs=1, batch_size=32)['loss'][-1], flush=True)\n"
    )
    from ..conftest import torchrun

    run = run_cmd([*torchrun(2), str(script)], timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    # each rank printed its line (counted in the text: rank 0's progress may share a line with it)
    assert run.stdout.count("final loss ") == 2 and "terminate called" not in run.stderr


@pytest.mark.slow
def test_a_stuck_rank_ends_the_job_within_the_timeout(tmp_path):
    stall = "+callbacks.stall={_target_:tests.helpers.StallOnRank,rank:1,step:3}"
    start = time.monotonic()
    run = run_train([stall, *FAST, "trainer.devices=2", "trainer.timeout_s=8"], tmp_path, timeout=120)
    elapsed = time.monotonic() - start
    text = run.stdout + run.stderr
    assert run.returncode != 0
    assert "made no progress for" in text and "trainer.timeout_s=8" in text, text[-3000:]
    assert "helpers/__init__.py" in text  # the stuck rank's stack shows where it is
    assert elapsed < 8 + 45, elapsed  # the stall plus startup, not torch's 30 minutes


@pytest.mark.slow
def test_the_python_api_is_watched_too_when_given_a_timeout(tmp_path):
    script = (
        "import functools, torch\n"
        "from framework import Engine\n"
        "from framework.data.datasets import synthetic\n"
        "from framework.models import MLP\n"
        "from tests.helpers import StallOnRank\n"
        "engine = Engine(MLP(hidden=[16]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),"
        " callbacks=[StallOnRank(rank=0, step=2)])\n"
        "engine.fit(synthetic(num_samples=256).train, epochs=1, batch_size=32, timeout_s=3)\n"
    )
    run = run_cmd([sys.executable, "-c", script], timeout=120)
    assert run.returncode == 1, run.stderr[-3000:]
    assert "made no progress for" in run.stderr and "helpers/__init__.py" in run.stderr, run.stderr[-3000:]


class Squatter:
    """A listener that accepts connections and never answers."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)


@pytest.mark.slow
def test_a_squatted_master_port_does_not_hang_a_run(tmp_path):
    # One process needs no port at all; the launcher's rendezvous must not pick the squatted one.
    squatter = Squatter()
    run = run_train(
        [*FAST, "trainer.max_steps=3", "trainer.devices=2"],
        tmp_path,
        timeout=120,
        env=subprocess_env(MASTER_PORT=str(squatter.port)),
    )
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.slow
def test_a_worker_killed_by_a_signal_is_named_and_the_launcher_leaves_no_temp_dir(tmp_path):
    kill = "+callbacks.kill={_target_:tests.helpers.KillRank,rank:1,step:3}"
    temp = tmp_path / "tmp"
    temp.mkdir()
    run = run_train(
        [kill, *FAST, "trainer.devices=2"],
        tmp_path / "run",
        timeout=180,
        env=subprocess_env(TMPDIR=str(temp)),
    )
    fails_cleanly(run, "worker rank 1 was killed by signal 9 (SIGKILL)")
    assert not list(temp.glob("torchelastic_*")) and not list(temp.glob("hydraspeed-launch-*"))


@pytest.mark.slow
def test_sigterm_to_launcher_and_workers_together_saves_and_exits_preempted(tmp_path):
    """What Slurm does: USR1 (`--signal=USR1@60`), then TERM, to every process of the job, the
    multiprocessing resource tracker among them (the launcher forwards its own too): the workers
    save once, the job exits EXIT_PREEMPTED (75) with no traceback, and resumes."""
    import signal

    proc = popen([sys.executable, str(ROOT / "train.py"), *FAST, "trainer.epochs=5", "trainer.devices=2",
                  "+callbacks.slow={_target_:tests.helpers.SlowDown,seconds:0.08}", f"hydra.run.dir={tmp_path}"])  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (tmp_path / "metrics.jsonl").exists():
        time.sleep(0.05)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGUSR1)
    time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # a tracker killed by USR1 and relaunched printed 9
    saved = checkpoint.find_resumable(tmp_path / "checkpoints")
    meta = json.loads((saved / "COMPLETE.json").read_text())
    assert meta["reason"] == "preempted" and 0 < meta["step"] < 110
    resumed = run_train([*FAST, "trainer.epochs=5", "trainer.resume=auto"], tmp_path)  # on 1 process
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert final_metrics(tmp_path)["step"] == 110


@pytest.mark.slow
def test_sigterm_with_no_checkpoint_to_save_exits_non_zero(tmp_path):
    """Checkpoints off: the preempted job cannot leave a checkpoint, so it does not claim success."""
    import signal

    proc = popen([sys.executable, str(ROOT / "train.py"), *FAST, "trainer.epochs=5", "trainer.devices=2",
                  "trainer.checkpoint.enabled=false", "+callbacks.slow={_target_:tests.helpers.SlowDown,seconds:0.08}",
                  f"hydra.run.dir={tmp_path}"])  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (tmp_path / "metrics.jsonl").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert "preempted (SIGTERM) before a checkpoint could be saved; last good checkpoint: none" in err
