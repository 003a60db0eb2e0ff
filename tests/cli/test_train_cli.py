"""`python train.py` as a user runs it: the default job, every strategy, and clear errors."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from ..conftest import CONF, FAST, ROOT, end_group, fails_cleanly, final_metrics, run_cmd, run_train

# Every strategy that runs on one process: the ZeRO stages. The pipeline and the tensor / sequence /
# expert parallel presets need 2 processes and their models (tests/engine/test_steps.py, test_parallel.py,
# test_tensor_parallel_checkpoints.py, test_sequence_parallel.py, test_expert_parallel.py).
STRATEGIES = sorted(p.stem for p in (CONF / "strategy").glob("zero*.yaml"))


@pytest.mark.slow
def test_default_run_learns_digits_and_writes_its_files(tmp_path):
    run = run_train([], tmp_path, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    final = final_metrics(tmp_path)
    assert final["val_accuracy"] >= 0.90
    # per-epoch progress and a final summary on the console
    assert run.stdout.count("epoch 10/10") >= 1 and "epoch 1/10" in run.stdout
    assert "run summary" in run.stdout and "val_accuracy" in run.stdout
    assert "\r" not in run.stdout  # not a terminal: plain lines, no redraws
    # files: resolved config, metrics.jsonl, the DeepSpeed config that was used
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert config["strategy"]["sharding"]["stage"] == 0 and "${" not in (tmp_path / "config.yaml").read_text()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    steps = [r for r in records if r["kind"] == "step"]
    assert len(epochs) == 10 and epochs[-1]["val_accuracy"] == pytest.approx(final["val_accuracy"])
    assert steps and all(r["step"] % 10 == 0 for r in steps)
    assert json.loads((tmp_path / "deepspeed_config.json").read_text())["train_batch_size"] == 64
    # DeepSpeed's own INFO noise stays hidden
    assert "[INFO]" not in run.stdout + run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_runs_end_to_end(tmp_path, strategy):
    run = run_train([f"+strategy={strategy}", *FAST], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    final = final_metrics(tmp_path)
    assert final["step"] == 22 and final["val_loss"] < 2.0
    ds = json.loads((tmp_path / "deepspeed_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == int(strategy[4])
    if strategy == "zero3_offload":  # no accelerator here: nothing to offload to, and the run says so
        assert "offload" not in json.dumps(ds)
        assert "offload has nowhere to move states to; running ZeRO-3 | fp32" in run.stdout


@pytest.mark.slow
def test_unknown_strategy_lists_options(tmp_path):
    fails_cleanly(run_train(["strategy=zero9"], tmp_path), "zero9", "zero3", "zero3_offload")


@pytest.mark.slow
def test_typo_key_names_the_key(tmp_path):
    fails_cleanly(run_train(["trainer.epoch=3"], tmp_path), "trainer.epoch")
    fails_cleanly(
        run_train(["+trainer.epoch=3"], tmp_path / "b"), "trainer.epoch", "did you mean 'trainer.epochs'"
    )


@pytest.mark.slow
def test_a_primary_config_in_ones_own_config_dir_passes_the_prechecks(tmp_path):
    """`-cd DIR -cn NAME`: the pre-checks find the primary config where Hydra does, so both
    forms of a group choice work and a typo'd key is named in one line."""
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "model" / "tiny.yaml").write_text("_target_: framework.models.MLP\nhidden: [16]\n")
    (conf / "mine.yaml").write_text("defaults:\n  - train\n  - override /model: tiny\n  - _self_\n")
    own = ["-cd", str(conf), "-cn", "mine", "+dry_run=true"]
    run = run_train([*own, "+strategy=zero3"], tmp_path / "a")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "MLP: 1,210 parameters" in run.stdout and '"stage": 3' in run.stdout
    typo = run_train([*own, "model.hiden=[8]"], tmp_path / "b")
    fails_cleanly(typo, "unknown config key 'model.hiden'; did you mean 'model.hidden'?")
    assert len(typo.stderr.strip().splitlines()) == 1, typo.stderr


# Runs train.py counting Hydra's compositions (a wrapper that keeps the loader's signature).
COUNT_COMPOSITIONS = """
import atexit, functools, runpy, sys
from hydra._internal.config_loader_impl import ConfigLoaderImpl
load, calls = ConfigLoaderImpl.load_configuration, []
@functools.wraps(load)
def counted(*args, **kwargs):
    calls.append(1)
    return load(*args, **kwargs)
ConfigLoaderImpl.load_configuration = counted
atexit.register(lambda: print(f"compositions: {len(calls)}"))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_overriding_an_untyped_key_composes_the_config_once(tmp_path):
    """`optimizer.lr=...` (the commonest override) is checked where Hydra composes, not by a
    second composition before it; a typo in it is still named in one line."""
    count = [sys.executable, "-c", COUNT_COMPOSITIONS, str(ROOT / "train.py"), "+dry_run=true"]
    run = run_cmd([*count, "optimizer.lr=0.05", f"hydra.run.dir={tmp_path / 'a'}"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compositions: 1" in run.stdout, run.stdout[-2000:]
    typo = run_cmd([*count, "optimizer.lrr=0.05", f"hydra.run.dir={tmp_path / 'b'}"])
    fails_cleanly(typo, "unknown config key 'optimizer.lrr'; did you mean 'optimizer.lr'?")


def test_the_dry_run_prints_the_deepspeed_config_the_runtime_passes(compose, capsys, tmp_path):
    """GPT at ZeRO-3: the printed config has the sizes DeepSpeed gets (its prefetch bucket is
    sized by the largest transformer block, not the largest tensor)."""
    from framework.backend.runtime import Runtime
    from framework.cli.build import train
    from framework.recipe import build_engine, tree_of
    from framework.recipe.build import strategy_of

    overrides = ["model=gpt", "data=chars", "loss=lm", "metrics=none", "+strategy=zero3"]
    overrides += ["data.dataset.max_chars=20000"]
    train(compose([*overrides, "+dry_run=true"]), str(tmp_path))
    printed = json.loads(capsys.readouterr().out.split("DeepSpeed config: ")[1].splitlines()[0])
    cfg = tree_of(compose(overrides))
    runtime = Runtime(strategy_of(cfg))
    try:
        build_engine(cfg, runtime, callbacks=[]).prepare("train", int(cfg["trainer"]["batch_size"]))
        assert printed == runtime.config
    finally:
        end_group()


@pytest.mark.slow
def test_uneven_global_batch_says_which_numbers(tmp_path):
    run = run_train(["trainer.batch_size=100", "strategy.gradient_merge.k_steps=8"], tmp_path)
    fails_cleanly(
        run, "trainer.batch_size: global batch size 100", "8 accumulation", "multiple of 8", "e.g. 96"
    )


EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@pytest.mark.slow
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_runs_in_fast_mode(tmp_path, experiment):
    run = run_train([f"experiment={experiment}", "trainer.max_steps=3", "trainer.epochs=1"], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert final_metrics(tmp_path)["step"] == 3


@pytest.mark.slow
def test_dry_run_prints_the_memory_plan_and_trains_nothing(tmp_path):
    run = run_train(["+dry_run=true", "+strategy=zero3"], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "per-rank model states:" in run.stdout and "DeepSpeed config:" in run.stdout
    assert '"stage": 3' in run.stdout and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_saved_deepspeed_config_is_what_deepspeed_received(tmp_path):
    """deepspeed_config.json holds the auto sizes DeepSpeed ran with (its own parsed config agrees)."""
    import functools

    import torch

    from framework import Engine, Strategy
    from framework.models import MLP
    from framework.plan.cost import auto_sizes, param_counts

    run = run_train(["+strategy=zero3", *FAST], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    saved = json.loads((tmp_path / "deepspeed_config.json").read_text())
    numel, largest = param_counts(MLP())
    sizes = auto_sizes(numel, largest)
    assert saved["zero_optimization"]["stage3_prefetch_bucket_size"] == sizes["prefetch_bucket_size"]
    assert saved["zero_optimization"]["reduce_bucket_size"] == sizes["reduce_bucket_size"]
    engine = Engine(
        MLP(),
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.AdamW, lr=1e-3),
        strategy=Strategy(sharding={"stage": 3}),
    )
    engine.prepare("train", 64)
    parsed = engine.runtime.deepspeed_engine._config.zero_config
    assert engine.runtime.deepspeed_engine.config == saved  # the dict DeepSpeed was given
    assert (parsed.prefetch_bucket_size, parsed.reduce_bucket_size, parsed.max_live_parameters) == (
        sizes["prefetch_bucket_size"],
        sizes["reduce_bucket_size"],
        sizes["max_live_parameters"],
    )
    end_group()
