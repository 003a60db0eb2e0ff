"""Checkpoints: SIGKILL at a random step then resume == an uninterrupted run, bit for bit;
atomic saves, auto-resume skipping partial saves, SIGTERM, export, another world size, pruning."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from framework import checkpoint
from framework.checkpoint.preemption import EXIT_PREEMPTED
from framework.export import fp32_state_dict, load_weights
from framework.models import MLP

from ..conftest import FAST, ROOT, end_group, final_metrics, popen, run_cmd, run_train, torchrun, train_aside

pytestmark = pytest.mark.timeout(600)

SLOW = "+callbacks.slow={_target_:tests.helpers.SlowDown,seconds:0.08}"
TWO_BATCH = "step={_target_:examples.iterator_step.two_batch_step,_partial_:true}"


GRPO = [
    "experiment=grpo_tiny",
    "trainer.batch_size=16",
    "trainer.max_steps=14",
    "objective.log_completions_every=4",
]
TIMING = ("samples_per_s", "tokens_per_s", "mfu")  # measured, not computed: they differ run to run


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records without the timing measurements."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING and not k.startswith("time_")}
        for line in lines
    ]


def start(args: list[str], run_dir: Path) -> subprocess.Popen:
    return popen([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"])


def kill_after(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 180) -> int:
    """SIGKILL the whole job once it logged `step` and has a complete checkpoint; the step it was at."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended before step {step}: {proc.stderr.read()[-2000:]}"
        try:
            steps = [r["step"] for r in records(run_dir) if r["kind"] == "step"]
        except (FileNotFoundError, json.JSONDecodeError):
            steps = []
        if steps and steps[-1] >= step and checkpoint.complete_checkpoints(run_dir / "checkpoints"):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return steps[-1]
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail("the run never reached the kill point")


CASES = {
    "zero1-2proc": ["+strategy=zero1", "trainer.devices=2"],
    "zero3-2proc": ["+strategy=zero3", "trainer.devices=2"],
    "two-batch-step": ["+strategy=zero2", TWO_BATCH],
    # LoRA: the checkpoint holds the adapters and their AdamW states; the frozen base is rebuilt.
    # The adapters' dropout draws the same masks after the resume (the loader's iterator, made
    # after the generators are put back, draws from its own generator)
    "lora-zero3": (
        "model=hf_llama model.config.hidden_size=32 model.config.intermediate_size=64 model.config.vocab_size=128 "
        "data=chars data.dataset.max_chars=20000 data.dataset.block_size=16 loss=lm metrics=none +adapter=lora "
        "adapter.dropout=0.1 +strategy=zero3 trainer.max_steps=16 trainer.batch_size=8 trainer.valid_steps=1"
    ).split(),
    # DPO with LoRA: two passes per step (adapters on, then off for the reference); rewards logged
    # every 3 steps, so the checkpoint at step 5 holds a window of rewards (steps 4-5) to resume.
    # A resumed run counts the FLOPs of its own first step: counting must not move a bit of it
    "dpo-lora": ["experiment=dpo_lora", "trainer.devices=1", "trainer.batch_size=1", "trainer.log_freq=3"],
    # GRPO, ZeRO-3 on 2 processes: completions sampled from generators seeded by (seed, step, index),
    # so the steps after the resume sample what the uninterrupted run sampled; with LoRA (dropout on:
    # its masks are drawn in the updates) and without (full fine-tuning). A sample of completions
    # every 4 steps: the file is cut back to the checkpoint and goes on.
    "grpo-lora-zero3": [*GRPO, "+adapter=lora", "adapter.dropout=0.1"],
    "grpo-zero3": GRPO,
}
COMMON = {
    "trainer.epochs": 2,
    "trainer.log_freq": 1,
    "trainer.checkpoint.save_freq": 5,
}  # unless a case sets it


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, case):
    given = {arg.split("=")[0] for arg in CASES[case]}
    args = [*CASES[case], *(f"{key}={value}" for key, value in COMMON.items() if key not in given)]
    killed_dir = tmp_path / "killed"
    # The uninterrupted run and the one to kill side by side (each is mostly start-up on 2 cores).
    with train_aside(args, tmp_path / "full") as uninterrupted:
        reached = kill_after(start([*args, SLOW], killed_dir), killed_dir, random.Random(case).randint(7, 9))
        full = uninterrupted.result()
    assert full.returncode == 0, full.stderr[-3000:]
    assert reached < final_metrics(tmp_path / "full")["step"]  # 12 steps or more in every case
    resumed = run_train([*args, "trainer.resume=auto"], killed_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    a, b = fp32_state_dict(tmp_path / "full" / "checkpoints"), fp32_state_dict(killed_dir / "checkpoints")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs after resuming (killed at step {reached})"
    if case == "dpo-lora":  # the rewards of training's window and of validation's pairs
        assert {"rewards/margins", "val_rewards/margins"} <= set().union(*records(killed_dir))
    if case.startswith("grpo"):  # the same completions and rewards, sampled after the resume too
        samples = (killed_dir / "completions.jsonl").read_text()
        assert samples == (tmp_path / "full" / "completions.jsonl").read_text() and '"step": 12' in samples
    assert records(killed_dir) == records(tmp_path / "full")  # every logged loss and metric, merged


def _two_checkpoint_run(tmp_path: Path) -> Path:
    run = run_train([*FAST, "trainer.checkpoint.save_freq=5", "trainer.checkpoint.keep_last_k=2"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    return tmp_path / "checkpoints"


@pytest.mark.slow
def test_keep_last_k_prunes_and_latest_points_at_the_newest(tmp_path):
    ckpts = _two_checkpoint_run(tmp_path)
    names = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_"))
    assert names == ["step_00000020", "step_00000022"]  # saved at 5, 10, 15, 20 and at the end
    assert (ckpts / "latest").read_text() == "step_00000022"
    meta = json.loads((ckpts / "step_00000022" / "COMPLETE.json").read_text())
    assert meta["step"] == 22 and meta["world_size"] == 1


@pytest.mark.slow
def test_auto_skips_a_partial_checkpoint_and_names_it_once(tmp_path, capfd):
    ckpts = _two_checkpoint_run(tmp_path)
    partial = ckpts / "step_00000030"
    shutil.copytree(ckpts / "step_00000022", partial)
    (partial / "COMPLETE.json").unlink()  # a save that died before it was marked complete
    assert checkpoint.find_resumable(ckpts) == ckpts / "step_00000022"
    assert "skipping partial checkpoint" in capfd.readouterr().err
    run = run_train([*FAST, "trainer.epochs=2", "trainer.resume=auto"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("skipping partial checkpoint") == 1 and "step_00000030" in run.stderr
    assert final_metrics(tmp_path)["step"] == 44


@pytest.mark.slow
def test_a_damaged_checkpoint_given_by_path_names_the_file(tmp_path):
    ckpts = _two_checkpoint_run(tmp_path)
    target = ckpts / "step_00000022" / "mp_rank_00_model_states.pt"
    target.write_bytes(target.read_bytes()[:100])  # truncated
    run = run_train([*FAST, f"trainer.resume={ckpts / 'step_00000022'}"], tmp_path / "again")
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "damaged" in run.stderr and "mp_rank_00_model_states.pt" in run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2])
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, devices):
    # devices=2: the signal reaches the launching parent only; torch elastic forwards it
    proc = start([*FAST, "trainer.epochs=5", SLOW, f"trainer.devices={devices}"], tmp_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (tmp_path / "metrics.jsonl").exists():
        time.sleep(0.05)
    while time.monotonic() < deadline and len(records(tmp_path)) < 3:
        time.sleep(0.05)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]  # saved, not finished: requeue me
    assert "preempted (SIGTERM): checkpoint saved at step" in out
    assert time.monotonic() - signalled < 20  # the launcher does not wait out torch elastic's 30 s
    saved = checkpoint.find_resumable(tmp_path / "checkpoints")
    step = json.loads((saved / "COMPLETE.json").read_text())["step"]
    assert 0 < step < 110
    resumed = run_train(
        [*FAST, "trainer.epochs=5", "trainer.resume=auto", f"trainer.devices={devices}"], tmp_path
    )
    assert resumed.returncode == 0 and final_metrics(tmp_path)["step"] == 110


@pytest.mark.slow
def test_export_loads_strict_into_the_plain_model_with_the_same_predictions(tmp_path):
    run = run_train(["+strategy=zero3", "trainer.devices=2", *FAST], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "weights.safetensors"
    cli = run_cmd([sys.executable, "-m", "framework.export", str(tmp_path / "checkpoints"), str(out)])
    assert cli.returncode == 0, cli.stderr
    assert (cli.stdout + cli.stderr).strip() == f"wrote {out}"  # one line: no DeepSpeed chatter
    model = MLP()
    model.load_state_dict(load_weights(out), strict=True)
    # the same predictions as the trained model in the run: its validation accuracy, recomputed
    from framework.data.datasets import digits

    valid = digits().valid
    x = torch.stack([valid[i][0] for i in range(len(valid))])
    y = torch.stack([valid[i][1] for i in range(len(valid))])
    with torch.no_grad():
        accuracy = float((model(x).argmax(1) == y).float().mean())
    assert accuracy == pytest.approx(final_metrics(tmp_path)["val_accuracy"], abs=1e-6)


# ZeRO-1 (no universal_checkpoint_info of its own) with SGD without momentum (no optimizer state
# at all), and SGD with momentum at ZeRO-3 (DeepSpeed's converter and ZeRO-3 loader know Adam's
# states only; Adam/AdamW across world sizes: the test below and the tensor-parallel ones); and
# SGD with momentum saved tensor parallel over both ranks (whose metric counts are duplicates).
RESIZE_CASES = ["zero1-sgd0", "zero3-sgd", "tp-zero1-sgd"]


@pytest.mark.slow
def test_resume_onto_another_number_of_processes_equals_the_uninterrupted_run(tmp_path):
    """2 processes save every 5 steps; 1 process continues from step 5 (mid-epoch) to the end:
    the same weights (momentum and Adam's moments carried), the same epoch loss and accuracy."""
    script = str(ROOT / "tests" / "scripts" / "resize_resume.py")
    for ranks, phase in ((2, "full"), (1, "resume")):
        run = run_cmd([*torchrun(ranks), script, str(tmp_path), phase, *RESIZE_CASES], timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
    for case in RESIZE_CASES:
        full, resumed = (torch.load(tmp_path / case / f"{phase}.pt") for phase in ("full", "resume"))
        for key, value in full["weights"].items():
            torch.testing.assert_close(
                resumed["weights"][key], value, atol=1e-6, rtol=0, msg=f"{case}: {key}"
            )
        assert resumed["history"].keys() == full["history"].keys()
        for key, values in full["history"].items():  # the epoch aggregates: the resumed epoch's too
            assert resumed["history"][key] == pytest.approx(values, abs=1e-6), f"{case}: {key}"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3"])  # ZeRO-1/2 (and SGD): the test above
def test_resume_a_two_process_checkpoint_on_one_process(tmp_path, strategy):
    args = [f"+strategy={strategy}", "trainer.epochs=2", "trainer.checkpoint.save_freq=10"]
    two = run_train([*args, "trainer.devices=2", "trainer.max_steps=30"], tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_train([*args, "trainer.resume=auto"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    final = final_metrics(tmp_path)
    assert final["step"] == 44 and final["val_accuracy"] > 0.8
    steps = [r["step"] for r in records(tmp_path) if r["kind"] == "step"]
    assert steps == sorted(set(steps)) and steps[-1] == 40  # continued from step 30, nothing repeated


def test_engine_save_and_load_round_trip(tmp_path):
    import functools

    from framework import Engine
    from framework.data.datasets import synthetic

    data = synthetic(num_samples=256)
    torch.manual_seed(0)
    engine = Engine(
        MLP(hidden=[32]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=1e-2)
    )
    engine.fit(data.train, epochs=1, batch_size=32)
    weights = engine.save(str(tmp_path / "w.safetensors"), training=False)
    ckpt = engine.save(str(tmp_path / "ckpts"), training=True)
    expected = engine.predict(data.valid, batch_size=32)
    end_group()
    for source in (weights, str(tmp_path / "ckpts")):
        fresh = Engine(
            MLP(hidden=[32]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=1e-2)
        )
        fresh.load(source)
        torch.testing.assert_close(torch.cat(fresh.predict(data.valid, batch_size=32)), torch.cat(expected))
        end_group()
    assert Path(ckpt).name == "step_00000006"


@pytest.mark.slow
def test_pipeline_sigkill_then_resume_logs_the_same_losses(tmp_path):
    """The pipeline engine too: killed after a checkpoint, resumed, every logged loss identical."""
    args = [
        "experiment=gpt_pipeline",
        "trainer.max_steps=16",
        "trainer.steps_per_epoch=8",
        "trainer.log_freq=1",
        "trainer.checkpoint.save_freq=4",
        "trainer.valid_at_start=false",
        "data.dataset.max_chars=200000",
    ]
    killed_dir = tmp_path / "killed"
    with train_aside(args, tmp_path / "full") as uninterrupted:
        reached = kill_after(start([*args, SLOW], killed_dir), killed_dir, 9)
        full = uninterrupted.result()
    assert full.returncode == 0, full.stderr[-3000:]
    assert reached < 16
    resumed = run_train([*args, "trainer.resume=auto"], killed_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert records(killed_dir) == records(tmp_path / "full")
