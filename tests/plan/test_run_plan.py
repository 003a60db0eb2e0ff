"""The two guarantees of the run plan (README "Guarantees"):

* order independence: fit, evaluate -> fit, load(weights) -> fit, trainer.init_from, the
  fine-grained dataloader -> prepare -> run, and a resume after a crash give the same lr
  sequence and the same weights as a plain fit;
* layout invariance: the same global batch gives the same update for any ranks x accumulation
  steps x ZeRO stage (token losses are normalised by the global count of counted tokens).

Plus the edge behaviours the plan decides: incomplete accumulations, steps cut short by the end
of the data, the default mode of prepare / dataloader / run, and arguments checked up front.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from framework import Callback, ConfigError, Engine, Strategy
from framework.data.datasets import synthetic
from framework.data.loaders import BatchIterator, Prefetcher
from framework.data.outputs import ModelLoss
from framework.engine import schedulers
from framework.engine.items import counted_items, step_weights, window_weights
from framework.models import MLP, LMLoss
from framework.plan.run_plan import Mesh, step_budget
from framework.plan.run_plan import batch_layout as layout_of

from ..conftest import FAST, end_group, run_layout_script, run_train

DATA = synthetic(num_samples=180)
EPOCHS, BATCH = 3, 16  # 144 training samples: 9 optimizer steps an epoch, 27 in all


COSINE = functools.partial(schedulers.warmup_cosine, warmup_fraction=0.2)


def engine(stage: int = 0, k_steps: int = 1, scheduler=COSINE, **kwargs) -> Engine:
    torch.manual_seed(0)
    return Engine(
        MLP(hidden=[32]),
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        scheduler=scheduler,
        strategy=Strategy(sharding={"stage": stage}, gradient_merge={"k_steps": k_steps}),
        **kwargs,
    )


class LrPerStep(Callback):
    """The learning rate after every optimizer step."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.step = 0

    def on_step_end(self, state):
        if state.global_step > self.step:
            self.step = state.global_step
            self.lrs.append(state.logs["lr"])


class CrashAt(Callback):
    """A crash in the middle of training (after the checkpoint of that step)."""

    def __init__(self, step: int) -> None:
        self.at = step

    def on_checkpoint_saved(self, state):
        if state.global_step == self.at:
            raise KeyboardInterrupt


def weights(e: Engine) -> dict[str, torch.Tensor]:
    return e.runtime.full_state_dict(on_every_rank=True)


def plain_fit(stage: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    e, lrs = engine(stage), LrPerStep()
    e.fit(DATA.train, epochs=EPOCHS, batch_size=BATCH, shuffle=False, callbacks=[lrs])
    return lrs.lrs, weights(e)


def assert_same_run(lrs, state, reference):
    ref_lrs, ref_state = reference
    assert len(ref_lrs) == EPOCHS * 9 and ref_lrs[4] > 2 * ref_lrs[-1]  # warm-up, then decay
    assert lrs == pytest.approx(ref_lrs, rel=1e-6)
    assert max((state[k] - v).abs().max().item() for k, v in ref_state.items()) < 1e-6


@pytest.mark.parametrize("stage", [0, 3])
def test_evaluate_or_load_before_fit_train_like_a_plain_fit(tmp_path, stage):
    reference = plain_fit(stage)
    start = tmp_path / "start.safetensors"
    for first in ("evaluate", "load"):
        e, lrs = engine(stage), LrPerStep()
        if first == "evaluate":
            e.evaluate(DATA.valid, batch_size=BATCH)
        else:
            e.prepare("predict")
            e.save(str(start), training=False)  # its own initial weights, then load them back
            e.load(str(start))
        e.fit(DATA.train, epochs=EPOCHS, batch_size=BATCH, shuffle=False, callbacks=[lrs])
        assert_same_run(lrs.lrs, weights(e), reference)


def test_the_fine_grained_flow_trains_like_fit():
    reference = plain_fit()
    e, lrs = engine(), []
    loader = e.dataloader(DATA.train, batch_size=BATCH, epochs=EPOCHS, mode="train")
    e.prepare(mode="train")
    for batch in loader:
        e.run(batch, mode="train")
        lrs.append(e.lr)
    assert_same_run(lrs, weights(e), reference)


def test_a_resume_after_a_crash_trains_like_an_uninterrupted_fit(tmp_path):
    reference = plain_fit()
    crashed = engine()
    with pytest.raises(KeyboardInterrupt):
        crashed.fit(
            DATA.train, epochs=EPOCHS, batch_size=BATCH, shuffle=False, save_dir=str(tmp_path), save_freq=5,
            callbacks=[CrashAt(10)],
        )  # fmt: skip
    end_group()
    e, lrs = engine(), LrPerStep()
    lrs.step = 10
    e.fit(DATA.train, epochs=EPOCHS, batch_size=BATCH, shuffle=False, save_dir=str(tmp_path), resume="auto",
          callbacks=[lrs])  # fmt: skip
    assert e.state.info.resumed_from.endswith("step_00000010")
    assert_same_run(reference[0][:10] + lrs.lrs, weights(e), reference)


@pytest.mark.slow
def test_init_from_on_the_command_line_keeps_the_schedule(tmp_path):
    """`trainer.init_from` (the fine-tuning path) decays over the run's steps, like a run without it."""
    from safetensors.torch import save_file

    start = tmp_path / "w.safetensors"
    torch.manual_seed(1)
    save_file(MLP(hidden=[64]).state_dict(), str(start))
    args = [*FAST, "model.hidden=[64]", "trainer.log_every=1", "trainer.epochs=2", "scheduler=cosine"]
    run = run_train([*args, f"trainer.init_from={start}"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if r["kind"] == "step"]
    base = max(lrs)
    opt = torch.optim.SGD([torch.zeros(1)], lr=base)
    expected = schedulers.warmup_cosine(opt, total_steps=len(lrs))
    want = []
    for _ in lrs:  # the lr logged after each step is the one the next step uses
        opt.step()
        expected.step()
        want.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx(want, rel=1e-5) and lrs[-1] < 0.2 * base


# ---------------------------------------------------------------------------------------- layout invariance


@pytest.mark.slow
def test_layout_invariance_on_two_ranks(tmp_path):
    """2 ranks x accumulation 1/4 x ZeRO 0-3, fit and run, the GPT with loss=lm and a Llama with
    loss=model: one SGD step on padded sequences (2 to 16 counted tokens) equals plain torch on
    the whole batch, and the logged loss is the global token mean."""
    for result in run_layout_script(tmp_path, "gpt,llama", "dp", "0,1,2,3", "1,4"):
        assert len(result["errors"]) == 2 * 4 * 2 * 2


def test_counted_items_follow_the_loss():
    labels = torch.tensor([[1, 2, -100, -100], [3, -100, -100, -100]])
    assert counted_items(labels, LMLoss(), None).item() == 3
    assert counted_items(labels, torch.nn.CrossEntropyLoss(ignore_index=2), None).item() == 7
    assert counted_items(labels, torch.nn.MSELoss(), None) is None  # a mean over samples: no weight
    assert counted_items(labels, ModelLoss(), torch.nn.Linear(1, 1)).item() == 3  # not a causal LM: unshifted
    summed = torch.nn.CrossEntropyLoss(reduction="sum")
    one = Mesh(world_size=1, rank=0)
    weights = step_weights([(None, labels[:1]), (None, labels[1:])], summed, None, "labels", one)
    assert [w.item() for w in weights] == pytest.approx([2 / 3, 2 / 3])  # ranks x accumulation / items
    mean = step_weights([(None, labels[:1]), (None, labels[1:])], LMLoss(), None, "labels", one)
    assert [w.item() for w in mean] == pytest.approx([4 / 3, 2 / 3])


def test_steps_counted_in_one_window_weigh_as_each_counted_alone():
    labels = torch.tensor([[1, 2, -100, -100], [3, -100, -100, -100], [4, 5, 6, -100]])
    steps = [
        [(None, labels[:1]), (None, labels[1:2])],
        [(None, labels[2:]), (None, labels[:1])],
        [(None, labels[1:2])] * 2,
    ]
    one = Mesh(world_size=1, rank=0)
    window = window_weights(steps, LMLoss(), None, "labels", one)
    assert window is not None and [len(w) for w in window] == [2, 2, 2]
    for together, step in zip(window, steps):
        alone = step_weights(step, LMLoss(), None, "labels", one)
        assert alone is not None and [w.item() for w in together] == [w.item() for w in alone]
    assert window_weights(steps, torch.nn.MSELoss(), None, "labels", one) is None  # no counts: no weights
    # one micro-batch per step on one rank: its own mean is the global batch's, no weight; its
    # count is still the step's (counted_items in the logs of a 1-process run)
    alone = window_weights([[(None, labels[:1])]] * 2, LMLoss(), None, "labels", one)
    assert alone is not None and not alone[0].weighted and alone[0].weight(0) is None
    assert alone[0].items() == 2
    summed = window_weights(
        [[(None, labels[:1])]], torch.nn.CrossEntropyLoss(reduction="sum"), None, "labels", one
    )
    assert summed is not None and summed[0][0].item() == pytest.approx(
        1 / 2
    )  # a sum still divides by its items


# ---------------------------------------------------------------------------------------- edges


def test_an_epoch_ends_at_an_optimizer_step_boundary():
    """20 samples, batch 8, 4 accumulation steps: 2 micro-batches are left at each epoch's end;
    they are dropped (as Paddle does), so 2 epochs take the 4 planned steps, none mixing epochs."""
    layout = layout_of(Strategy(gradient_merge={"k_steps": 4}), 8, 1)
    budget = step_budget(layout, loader_batches=10, epochs=2)
    assert (budget.batches_per_epoch, budget.steps_per_epoch, budget.total_steps) == (8, 2, 4)
    e = engine(k_steps=4)
    e.fit(
        torch.utils.data.TensorDataset(torch.randn(20, 64), torch.randint(0, 10, (20,))),
        epochs=2,
        batch_size=8,
    )
    assert (e.state.global_step, e.total_steps, e.runtime.micro_steps) == (4, 4, 16)


def test_steps_per_epoch_counts_optimizer_steps_for_an_iterator_step():
    def two_batches(engine, dataloader_iter):
        (x1, y1), (x2, y2) = next(dataloader_iter), next(dataloader_iter)
        return (engine.loss(engine.model(x1), y1) + engine.loss(engine.model(x2), y2)) / 2

    e = engine(train_step=two_batches)
    e.fit(DATA.train, epochs=2, batch_size=BATCH, steps_per_epoch=3)
    assert e.state.global_step == 6 and e.state.batches_fetched == 12


def test_a_manual_step_cut_short_by_the_data_leaves_no_gradient_behind():
    """The epoch's last call backpropagates a batch and then finds no second one: that gradient
    must not leak into the next epoch's first step (whose update must equal a clean one)."""

    def manual(engine, dataloader_iter):
        x, y = next(dataloader_iter)
        engine.backward(engine.loss(engine.model(x), y))
        x, y = next(dataloader_iter)  # StopIteration on an odd batch count
        engine.backward(engine.loss(engine.model(x), y))
        engine.step()
        return {}

    data = torch.utils.data.TensorDataset(torch.randn(3 * BATCH, 64), torch.randint(0, 10, (3 * BATCH,)))
    cut = engine(train_step=manual, scheduler=None)  # the same lr whatever the planned step count
    cut.fit(data, epochs=2, batch_size=BATCH, shuffle=False)
    clean = engine(train_step=manual, scheduler=None)
    clean.fit(torch.utils.data.Subset(data, range(2 * BATCH)), epochs=2, batch_size=BATCH, shuffle=False)
    assert cut.state.global_step == clean.state.global_step == 2
    diff = max((a - b).abs().max().item() for a, b in zip(weights(cut).values(), weights(clean).values()))
    assert diff < 1e-7


def test_a_step_that_stepped_before_the_data_ran_out_is_counted(tmp_path):
    def step_then_stop(engine, dataloader_iter):
        x, y = next(dataloader_iter)
        engine.backward(engine.loss(engine.model(x), y))
        engine.step()
        next(dataloader_iter)  # raises StopIteration after the third batch: that step counts
        return {}

    e = engine(train_step=step_then_stop)
    e.fit(DATA.train, epochs=1, batch_size=BATCH * 3, save_dir=str(tmp_path))
    assert e.state.global_step == e.runtime.global_steps == 2
    assert (tmp_path / "step_00000002").is_dir()


def test_prepare_dataloader_and_run_default_to_the_current_mode():
    e = engine()
    loader = e.dataloader(DATA.valid, batch_size=BATCH, mode="predict")
    e.prepare()
    out = e.run(next(iter(loader)))
    assert "outputs" in out and e.runtime.global_steps == 0  # predicted: no optimizer step
    assert e.dataloader(DATA.valid, batch_size=BATCH) is not None and e.mode == "predict"


def test_the_prefetcher_keeps_exactly_its_depth_ahead():
    pulled = []

    def source():
        for i in range(10):
            pulled.append(i)
            yield i

    prefetcher = Prefetcher(source(), lambda b: b, depth=2, background=True)
    batches = BatchIterator(prefetcher)
    next(batches)
    import time

    time.sleep(0.3)
    assert len(pulled) - batches.fetched == 2
    prefetcher.close()


def _prefetch_threads() -> int:
    import threading

    return sum(t.name == "hydraspeed-prefetch" for t in threading.enumerate())


def test_a_cpu_rank_without_a_core_to_spare_pulls_inline_unless_pulling_waits(monkeypatch):
    import os
    import time

    from framework.data.loaders import WATCH_PULLS
    from framework.data.transfer import Copier

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))  # as many ranks here as cores
    before, cpu = _prefetch_threads(), Copier(torch.device("cpu"))
    inline = Prefetcher(iter(range(3 * WATCH_PULLS)), cpu, depth=2)  # pulling is work: no thread
    assert [batch for batch, _ in inline] == list(range(3 * WATCH_PULLS)) and _prefetch_threads() == before

    def waiting():  # a loader that waits (on files, workers): a thread takes over and hides it
        for i in range(3 * WATCH_PULLS):
            time.sleep(0.005)
            yield i

    handed = Prefetcher(waiting(), cpu, depth=2)
    got = [next(handed)[0] for _ in range(WATCH_PULLS)]
    assert _prefetch_threads() == before + 1
    assert got + [batch for batch, _ in handed] == list(range(3 * WATCH_PULLS))  # nothing lost or repeated
    handed.close()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    if cores > 1:  # one rank with cores to spare: a thread pulls ahead from the start
        ahead = Prefetcher(iter(range(3)), cpu, depth=2)
        assert _prefetch_threads() == before + 1 and [batch for batch, _ in ahead] == [0, 1, 2]
        ahead.close()


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: Engine(object()), "torch.nn.Module"),
        (lambda: Engine(MLP(), torch.nn.CrossEntropyLoss(), "adam"), "torch optimizer or a factory"),
        (lambda: Engine(MLP(), torch.nn.CrossEntropyLoss(), None, ["acc"]), "metric '0' is 'acc'"),
        (lambda: Engine(MLP(), "nll"), "callable loss"),
        (lambda: engine().fit(DATA.train, 3), "keyword arguments"),
        (lambda: engine().fit(DATA.train, epoch=3), "unknown option(s) ['epoch']"),
    ],
)
def test_wrong_arguments_fail_before_anything_trains(call, words):
    with pytest.raises(ConfigError) as info:
        call()
    assert words in str(info.value)


def test_the_mesh_derives_the_data_parallel_degree():
    assert (Mesh(8, 5, 2).dp_size, Mesh(8, 5, 2).dp_rank) == (4, 1)
    with pytest.raises(ConfigError, match="does not divide"):
        layout_of(Strategy(pipeline={"stages": 3}), 12, 4)


def test_training_mode_comes_back_after_a_failed_evaluation():
    e = engine()
    e.prepare("train")
    bad = torch.utils.data.TensorDataset(torch.randn(16, 64), torch.randint(0, 10, (16, 3)))  # wrong labels
    with pytest.raises(ConfigError):
        e.evaluate(bad, batch_size=16)
    assert e.runtime.training


def test_a_hugging_face_schedule_gets_the_run_budget():
    """`num_training_steps` is filled like `total_steps`: the schedule ends at 0 on the last step."""
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    schedule = functools.partial(transformers.get_cosine_schedule_with_warmup, num_warmup_steps=2)
    e, lrs = engine(scheduler=schedule), LrPerStep()
    e.fit(DATA.train, epochs=2, batch_size=BATCH, callbacks=[lrs])
    assert (
        len(lrs.lrs) == 18
        and lrs.lrs[1] == pytest.approx(0.1)
        and lrs.lrs[-1] == pytest.approx(0.0, abs=1e-9)
    )


# ---------------------------------------------------------------------------------------- one vocabulary


def test_the_command_line_and_the_python_api_share_names_and_defaults(compose, tmp_path):
    """`trainer.*` uses `fit`'s names, with `FitConfig`'s defaults; the differences are the
    shipped demo run's choices (10 epochs of 64 with a watchdog) and the console, which the
    CLI's logger group decides, named here."""
    import inspect

    from framework.engine.fit_config import FitConfig
    from framework.recipe import tree_of
    from framework.recipe.options import fit_options

    cfg = compose()
    built = fit_options(tree_of(cfg), tmp_path, None).as_kwargs()
    defaults = FitConfig().as_kwargs()
    demo = {"epochs": 10, "batch_size": 64, "timeout_s": 300.0, "save_dir": str(tmp_path), "progress": False}
    assert {k: v for k, v in built.items() if v != defaults[k]} == demo
    assert inspect.signature(Engine).parameters["prefetch"].default == cfg.data.prefetch


def test_old_trainer_keys_still_work_with_one_line(compose, tmp_path, capsys):
    from framework.recipe import tree_of
    from framework.recipe.options import fit_options

    cfg = compose(["trainer.log_every=3", "trainer.checkpoint.every_n_steps=7", "trainer.valid_freq=2"])
    built = fit_options(tree_of(cfg), tmp_path, None)
    assert (built.log_freq, built.save_freq, built.valid_freq) == (3, 7, 2)
    out = capsys.readouterr().out
    assert "trainer.log_every is deprecated: use trainer.log_freq" in out
    assert "trainer.checkpoint.every_n_steps is deprecated: use trainer.checkpoint.save_freq" in out


def test_engine_fit_prints_progress_unless_told_not_to(capsys):
    engine().fit(DATA.train, epochs=1, batch_size=BATCH, log_freq=3)
    shown = capsys.readouterr().out
    assert "epoch 1/1" in shown or "step 3" in shown, shown[-500:]
    engine().fit(DATA.train, epochs=1, batch_size=BATCH, log_freq=3, progress=False)
    assert capsys.readouterr().out == ""


# ----------------------------------------------------------------------------- limits that disagree


def test_a_max_steps_the_epochs_end_before_is_named_with_the_key_that_reaches_it():
    layout = layout_of(Strategy(), 8, 1)
    budget = step_budget(layout, loader_batches=15, epochs=10, max_steps=200)
    assert budget.total_steps == 150
    (note,) = budget.notes
    assert "max_steps=200 is not reached" in note and "150" in note and "trainer.epochs=14" in note
    assert (
        step_budget(layout, loader_batches=15, epochs=10, max_steps=100).notes == ()
    )  # max_steps wins, as asked
    assert step_budget(layout, loader_batches=15, epochs=10).notes == ()


def test_the_samples_an_epoch_leaves_out_are_said_once_the_same_on_every_layout():
    """14 rows, global batch 8: 6 left out of every epoch without a word. The note is the
    layout's (2 ranks x 2 accumulation steps say what 1 rank says), and a fit shows it once."""
    one, two = layout_of(Strategy(), 8, 1), layout_of(Strategy(gradient_merge={"k_steps": 2}), 8, 2)
    (note,) = step_budget(one, loader_batches=1, epochs=3, samples=14).notes
    assert (
        note.startswith("an epoch trains 8 of the 14 samples: the last 6 of its order")
        and "trainer.batch_size" in note
    )
    assert step_budget(two, loader_batches=2, epochs=3, samples=14).notes == (note,)
    assert step_budget(one, loader_batches=2, epochs=3, samples=16).notes == ()  # nothing left out
    assert step_budget(one, loader_batches=2, epochs=3, steps_per_epoch=1, samples=20).notes == ()  # capped
    e = engine()
    data = torch.utils.data.TensorDataset(torch.randn(14, 64), torch.randint(0, 10, (14,)))
    e.fit(data, epochs=2, batch_size=8, progress=False)
    assert e.state.info.notes.count(note) == 1 and e.state.global_step == 2
    e.close()


def test_a_stream_says_both_limits_and_what_the_schedule_is_planned_for():
    from framework.plan.run_plan import stream_budget

    (note,) = stream_budget(layout_of(Strategy(), 8, 1), epochs=10, max_steps=200).notes
    assert "max_steps=200 or after 10 pass(es)" in note and "trainer.epochs" in note


def test_a_warm_up_as_long_as_the_run_is_said_at_start_and_the_final_line_names_the_limit(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    from framework.plan.run_plan import warmup_note

    assert warmup_note(functools.partial(schedulers.constant, warmup_steps=2), 3) is None
    e = Engine(
        MLP(hidden=[16]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1),
        scheduler=functools.partial(schedulers.constant, warmup_steps=100),
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.randn(24, 64), torch.randint(0, 10, (24,)))
    e.fit(
        data,
        valid_data=data,
        epochs=1,
        batch_size=8,
        max_steps=5,
        valid_freq=2,
        save_dir="ckpts",
        save_freq=9,
    )
    out = capsys.readouterr().out
    assert "note: scheduler.warmup_steps=100 is not shorter than the run's 3 optimizer steps" in out
    assert "note: max_steps=5 is not reached: 1 epoch(s) of 3 optimizer steps" in out
    assert "note: valid_freq=2 is past the run's 1 epoch(s): no validation runs" in out
    assert "note: save_freq=9 is past the run's 3 optimizer steps: only the final checkpoint" in out
    assert e.state.stop_reason == "after trainer.epochs=1; trainer.max_steps=5 not reached"
    assert "(after trainer.epochs=1; trainer.max_steps=5 not reached)" in out


def test_a_first_python_api_fit_warns_nothing_and_prints_no_mfu_hint_on_a_cpu(capsys):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the suite's own filters off: every warning is seen
        engine(stage=3).fit(DATA.train, epochs=1, batch_size=BATCH, steps_per_epoch=2)
    hidden = (DeprecationWarning, PendingDeprecationWarning)  # Python shows these only in __main__
    assert [str(w.message) for w in caught if not issubclass(w.category, hidden)] == []
    assert "peak_tflops" not in capsys.readouterr().out


class LoggedLosses(Callback):
    """The `loss` of every logged record, by step."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_step_end(self, state):
        if state.log_now:
            self.losses[state.global_step] = state.logs["loss"]


def test_a_record_covers_the_steps_since_the_previous_one_across_epoch_ends():
    """2 optimizer steps per epoch, a record every 3 steps: each record's loss is the mean of the
    3 per-step losses of a log_freq=1 run over the same steps, across the epoch ends between them,
    as HF and TRL log it (it restarted at every epoch's end)."""
    data = synthetic(num_samples=40)  # 32 training samples, batch 16: 2 steps an epoch
    every, each = LoggedLosses(), LoggedLosses()
    with engine(callbacks=[every]) as one:
        one.fit(data.train, epochs=6, batch_size=BATCH, log_freq=1, shuffle=False, progress=False)
    with engine(callbacks=[each]) as three:
        three.fit(data.train, epochs=6, batch_size=BATCH, log_freq=3, shuffle=False, progress=False)
    assert sorted(each.losses) == [3, 6, 9, 12]
    for step, loss in each.losses.items():
        want = sum(every.losses[s] for s in range(step - 2, step + 1)) / 3
        assert loss == pytest.approx(want, abs=1e-6), step
