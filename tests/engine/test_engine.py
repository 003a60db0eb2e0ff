"""Engine in-process: fit/evaluate/predict semantics on one process."""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch
import torchmetrics

from framework import ConfigError, Engine, Strategy
from framework.data.datasets import synthetic
from framework.data.loaders import EvalShardSampler
from framework.models import MLP
from framework.observe.callbacks import Callback, LearningRateMonitor

from ..conftest import end_group


def make_engine(stage: int = 0, **kwargs) -> Engine:
    torch.manual_seed(0)
    return Engine(
        MLP(hidden=[32]),
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.AdamW, lr=1e-2),
        torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro"),
        **{"strategy": Strategy(sharding={"stage": stage}), **kwargs},
    )


@pytest.mark.parametrize("n, replicas", [(10, 3), (7, 2), (4, 4), (3, 4)])
def test_eval_shards_cover_every_sample_once(n, replicas):
    samplers = [EvalShardSampler(n, replicas, r) for r in range(replicas)]
    assert len({len(s) for s in samplers}) == 1  # equal lengths: no rank waits in a collective
    real = [i for s in samplers for i in list(s)[: s.unpadded]]
    assert sorted(real) == list(range(n))


def test_fit_returns_per_epoch_history_and_learns():
    splits = synthetic(num_samples=512)
    engine = make_engine()
    history = engine.fit(splits.train, splits.valid, epochs=3, batch_size=32)
    assert set(history) == {"loss", "lr", "accuracy", "val_loss", "val_accuracy"}
    assert all(len(v) == 3 for v in history.values())
    assert history["val_loss"][-1] < history["val_loss"][0]
    assert history["val_accuracy"][-1] > 0.9
    assert engine.state.global_step == 3 * (len(splits.train) // 32)


def test_max_steps_counts_optimizer_steps_with_accumulation():
    splits = synthetic(num_samples=512)
    engine = make_engine(strategy=Strategy(gradient_merge={"k_steps": 2}))
    engine.fit(splits.train, epochs=5, batch_size=32, max_steps=7)
    assert engine.state.global_step == 7
    assert engine.state.batches_fetched == 14  # two micro-batches of 16 per optimizer step
    assert engine.deepspeed_config["gradient_accumulation_steps"] == 2


def test_evaluate_matches_a_plain_torch_computation():
    splits = synthetic(num_samples=300)
    engine = make_engine()
    engine.fit(splits.train, epochs=1, batch_size=32)
    result = engine.evaluate(splits.valid, batch_size=16)
    x = torch.stack([splits.valid[i][0] for i in range(len(splits.valid))])
    y = torch.stack([splits.valid[i][1] for i in range(len(splits.valid))])
    with torch.no_grad():
        logits = engine.module(x)
    assert result["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y)), rel=1e-5)
    assert result["accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()), abs=1e-6)


@pytest.mark.parametrize("stage", [0, 3])
def test_predict_returns_outputs_in_dataset_order(stage):
    splits = synthetic(num_samples=100)
    engine = make_engine(stage)
    out = engine.predict(splits.valid, batch_size=8)
    assert [len(o) for o in out] == [8, 8, 4]
    x = torch.stack([splits.valid[i][0] for i in range(len(splits.valid))])
    engine.model.eval()
    with torch.no_grad():
        expected = engine.model(x)
    torch.testing.assert_close(torch.cat(out), expected)


def test_training_needs_loss_and_optimizer():
    engine = Engine(MLP(), loss=torch.nn.CrossEntropyLoss())
    with pytest.raises(ConfigError, match="set optimizer and loss before training"):
        engine.prepare("train")
    with pytest.raises(ConfigError, match="set loss before evaluation"):
        Engine(MLP()).prepare("eval")
    with pytest.raises(ValueError, match="'train', 'eval', 'predict'"):
        engine.prepare("validate")


class TakesLabels(MLP):
    """Accepts labels= but computes no loss of its own."""

    def forward(self, x, labels=None):
        return super().forward(x)


def test_the_models_own_loss_from_a_model_without_one_is_a_config_error():
    engine = Engine(TakesLabels(hidden=[8]), "model", functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(ConfigError, match="loss=model, but the model returned a Tensor without a loss"):
        engine.fit(synthetic(num_samples=64).train, epochs=1, batch_size=32, max_steps=1)


def test_bf16_strategy_trains_in_bf16():
    splits = synthetic(num_samples=256)
    torch.manual_seed(0)
    engine = Engine(
        MLP(hidden=[32]),
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.AdamW, lr=1e-2),
        strategy=Strategy(sharding={"stage": 2}, amp={"enable": True, "dtype": "bf16"}),
    )
    history = engine.fit(splits.train, splits.valid, epochs=2, batch_size=32)
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    assert history["val_loss"][-1] < history["val_loss"][0]


_RSS_AFTER_FREES = """
import sys, psutil, torch
from framework.process import allocator, context as device
applied = allocator.tune_host_allocator() if sys.argv[1] == "fix" else False
process = psutil.Process()
before = process.memory_info().rss
for _ in range(3):  # a 24 MiB buffer freed and made again, like a gathered layer each step
    buffer = torch.ones(6 << 20)
    del buffer
print(applied, (process.memory_info().rss - before) / 2**20)
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or torch.cuda.is_available(), reason="glibc, CPU runs"
)
@pytest.mark.slow
def test_freed_large_buffers_go_back_to_the_os_on_cpu():
    from ..conftest import run_cmd, subprocess_env

    env = {k: v for k, v in subprocess_env().items() if not k.startswith("MALLOC_")}
    results = {}
    for mode in ("fix", "glibc-default"):
        run = run_cmd([sys.executable, "-c", _RSS_AFTER_FREES, mode], env=env, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        applied, grown = run.stdout.split()[-2:]
        results[mode] = (applied, float(grown))
    assert results["fix"][0] == "True"
    assert results["fix"][1] < 8  # each buffer was unmapped when freed
    assert results["glibc-default"][1] > 16  # glibc's raised threshold kept one resident


def test_allocator_setting_respects_the_users_malloc_variables(monkeypatch):
    from framework.process import allocator

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert allocator.tune_host_allocator() is False


def _gpt_steps(
    stage: int, recompute: bool, steps: int = 3
) -> tuple[list[float], dict[str, torch.Tensor], int]:
    from framework.models import GPT, LMLoss

    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    calls = []
    for block in model.blocks:
        block.register_forward_hook(lambda *_: calls.append(1))
    engine = Engine(
        model,
        LMLoss(),
        functools.partial(torch.optim.AdamW, lr=1e-2),
        strategy=Strategy(sharding={"stage": stage}, recompute={"enable": recompute}),
    )
    engine.prepare("train", 8)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 32, (8, 17), generator=g)
        losses.append(engine.run((ids[:, :-1], ids[:, 1:]), mode="train")["loss"])
    weights = engine.runtime.full_state_dict()
    end_group()
    return losses, weights, len(calls)


@pytest.mark.parametrize("stage", [0, 3])
def test_recompute_reruns_each_block_in_backward_and_changes_no_number(stage):
    plain_losses, plain_weights, plain_calls = _gpt_steps(stage, recompute=False)
    losses, weights, calls = _gpt_steps(stage, recompute=True)
    assert plain_calls == 3 * 2  # 3 steps x 2 blocks
    assert calls == 2 * plain_calls  # each block ran again in backward (hooks included: ZeRO-3 gathers)
    assert losses == plain_losses  # dropout replayed with the same RNG state
    assert weights.keys() == plain_weights.keys()  # no wrapper in the names: checkpoints interchange
    for name, value in weights.items():
        assert torch.equal(value, plain_weights[name]), name


def test_recompute_without_blocks_is_a_clear_error():
    engine = Engine(
        MLP(hidden=[16]),
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.AdamW, lr=1e-2),
        strategy=Strategy(recompute={"enable": True}),
    )
    with pytest.raises(ConfigError, match="MLP has no blocks to recompute"):
        engine.prepare("train", 8)


def test_optimizer_named_in_the_strategy_trains_without_an_optimizer_argument():
    splits = synthetic(num_samples=256)
    torch.manual_seed(0)
    strategy = Strategy(deepspeed={"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    engine = Engine(MLP(hidden=[32]), torch.nn.CrossEntropyLoss(), optimizer=None, strategy=strategy)
    history = engine.fit(splits.train, splits.valid, epochs=3, batch_size=32)
    assert isinstance(engine.runtime.optimizer, torch.optim.AdamW)  # DeepSpeed built torch's AdamW
    assert engine.lr == pytest.approx(1e-2)
    assert history["val_loss"][-1] < history["val_loss"][0]


@pytest.mark.parametrize("stage", [1, 2])
def test_auto_buckets_suit_deepspeed_for_any_parameter_count(stage):
    # 916,667 parameters: P / 8 is odd, and ZeRO-1/2 assert an even allgather bucket
    model = MLP(in_features=256, hidden=[2001, 200])
    assert sum(p.numel() for p in model.parameters()) // 8 % 2 == 1
    engine = Engine(
        model,
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        strategy=Strategy(sharding={"stage": stage}),
    )
    engine.prepare("train", 8)
    assert engine.deepspeed_config["zero_optimization"]["allgather_bucket_size"] == 114_624
    loss = engine.run((torch.randn(8, 256), torch.randint(0, 10, (8,))), mode="train")["loss"]
    assert loss > 0


@pytest.mark.slow
def test_digits_are_scikit_learns_digits_without_importing_it():
    import numpy as np
    from sklearn.datasets import load_digits

    from framework.data.datasets.classification import _shipped_digits

    table, reference = _shipped_digits(), load_digits()
    assert np.array_equal(table[:, :-1], reference.data) and np.array_equal(table[:, -1], reference.target)
    code = "import sys; from framework.data.datasets import digits; digits(); print('sklearn' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip().splitlines()[-1] == "False"  # ~0.8 s of import a default run skips


# ---------------------------------------------------------------- one owner for the batch layout


def test_an_evaluation_batch_size_does_not_freeze_the_training_layout(tmp_path):
    """evaluate(batch_size=120) before fit(batch_size=64): training and its checkpoint use 64;
    a later training call with another global batch is a clear error."""
    splits = synthetic(num_samples=512)
    engine = make_engine()
    engine.evaluate(splits.valid, batch_size=120)
    engine.fit(splits.train, epochs=1, batch_size=64, save_dir=str(tmp_path))
    assert engine.runtime.layout.micro_batch_size == 64
    (saved,) = [p for p in tmp_path.iterdir() if p.name.startswith("step_")]
    assert json.loads((saved / "COMPLETE.json").read_text())["micro_batch_size"] == 64
    with pytest.raises(ConfigError, match="trains with a global batch of 64 .*not 32"):
        engine.fit(splits.train, epochs=1, batch_size=32)


def test_evaluation_is_not_split_into_accumulation_steps():
    """With 4 accumulation steps, evaluate(batch_size=10) runs (evaluation never accumulates)."""
    splits = synthetic(num_samples=300)
    engine = make_engine(strategy=Strategy(gradient_merge={"k_steps": 4}))
    x = torch.stack([splits.valid[i][0] for i in range(len(splits.valid))])
    y = torch.stack([splits.valid[i][1] for i in range(len(splits.valid))])
    for _ in range(2):  # before training (the first call builds DeepSpeed), and after
        result = engine.evaluate(splits.valid, batch_size=10)
        with torch.no_grad():
            expected = float(torch.nn.functional.cross_entropy(engine.module(x), y))
        assert result["loss"] == pytest.approx(expected, rel=1e-5)
        engine.fit(splits.train, epochs=1, batch_size=32)


def _gathered_per_step(monkeypatch, evaluate_first: bool) -> list[int]:
    """Elements ZeRO-3 gathered in each of 4 training steps of a small MLP on one rank."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    name = "_PartitionedParameterCoordinator__all_gather_params"
    gather = getattr(PartitionedParameterCoordinator, name)
    gathered = [0]

    def counting(self, params, forward):
        gathered[0] += sum(p.ds_numel for p in params)
        return gather(self, params, forward)

    monkeypatch.setattr(PartitionedParameterCoordinator, name, counting)
    engine = make_engine(stage=3)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(4)]
    engine.prepare("train", 16)
    engine.prepare("eval", 16)
    if evaluate_first:
        for batch in batches[:3]:  # more than one: the coordinator completes a forward-only trace
            engine.run(batch, mode="eval")
    per_step = []
    for batch in batches:
        gathered[0] = 0
        engine.run(batch, mode="train")
        per_step.append(gathered[0])
    end_group()
    return per_step


def test_zero3_gathers_each_weight_once_per_step_after_an_evaluation_first(monkeypatch):
    # DeepSpeed 0.19 memoises which weights to free after each module per position in its module
    # trace and keeps the memo when the trace is replaced: after a forward-only (eval) trace every
    # later forward freed the weights backward needs, and backward gathered them again.
    plain = _gathered_per_step(monkeypatch, evaluate_first=False)
    after_eval = _gathered_per_step(monkeypatch, evaluate_first=True)
    assert plain[-1] > 0
    assert after_eval[-2:] == plain[-2:]


def test_zero3_loads_whole_weights_one_module_at_a_time(monkeypatch, tmp_path):
    import deepspeed

    from framework.backend.weights import save_weights
    from framework.models import GPT, LMLoss

    torch.manual_seed(1)
    source = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
    path = save_weights(source.state_dict(), tmp_path / "w.safetensors")
    gathered: list[int] = []
    real = deepspeed.zero.GatheredParameters

    def spy(params, *args, **kwargs):
        gathered.append(sum(p.ds_numel for p in params) if kwargs.get("enabled", True) else 0)
        return real(params, *args, **kwargs)

    torch.manual_seed(0)
    engine = Engine(
        GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32),
        LMLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        strategy=Strategy(sharding={"stage": 3}),
    )
    engine.prepare("train", 8)
    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", spy)
    engine.load(str(path))
    monkeypatch.undo()
    loaded = engine.runtime.full_state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in source.state_dict().items())
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in source.modules())
    assert 0 < max(gathered) <= largest_module < sum(p.numel() for p in source.parameters())


def test_a_new_engine_after_the_user_destroyed_the_process_group_trains():
    """DeepSpeed caches process groups in its module globals; after the user's own
    `destroy_process_group()` they are stale and the next engine's DeepSpeed failed on them."""
    import torch.distributed as dist

    data = synthetic(num_samples=128, num_features=16, num_classes=4)
    histories = []
    for _ in range(2):
        torch.manual_seed(0)
        engine = Engine(
            MLP(in_features=16, hidden=[8], num_classes=4),
            torch.nn.CrossEntropyLoss(),
            functools.partial(torch.optim.SGD, lr=0.1),
            strategy=Strategy(sharding={"stage": 2}),
        )
        histories.append(engine.fit(data.train, batch_size=32, progress=False))
        dist.destroy_process_group()
    assert histories[0]["loss"] == histories[1]["loss"]


class _Timing(Callback):
    def on_step_end(self, state):
        pass


class _Declared(_Timing):
    stops_alike = True


class _AtEpochEnd(Callback):
    def on_epoch_end(self, state):
        pass


@pytest.mark.parametrize(
    "callbacks, step, per_step",
    [
        ([], None, False),  # the framework's own callbacks (the console) never stop on one rank
        ([LearningRateMonitor(), _AtEpochEnd()], None, False),  # no step-level handler of the user's
        ([_Timing()], None, True),  # a step-level handler may stop on some ranks only
        ([_Declared()], None, False),  # ... unless it says it never does
        ([], lambda engine, batch: engine.loss(engine.model(batch[0]), batch[1]), True),  # gets the state
    ],
)
def test_ranks_agree_on_stopping_at_every_step_only_when_a_stop_can_be_asked_on_one(
    monkeypatch, callbacks, step, per_step
):
    """The per-step stop agreement (a collective) is paid only where a stop may be asked on some
    ranks only; the epoch's end is agreed on in any case."""
    from framework.process.context import ProcessContext

    calls = []
    agree = ProcessContext.agree
    monkeypatch.setattr(ProcessContext, "agree", lambda self, *a: calls.append(a) or agree(self, *a))
    engine = make_engine(callbacks=callbacks, train_step=step)
    data = synthetic(num_samples=256).train
    engine.fit(data, epochs=2, batch_size=32, progress=False)
    per_epoch = len(data) // 32
    assert engine.state.global_step == 2 * per_epoch
    # per epoch: a check before each step and after the last, then the epoch's end
    assert len(calls) == (2 * (per_epoch + 2) if per_step else 2)
