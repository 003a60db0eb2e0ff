"""Autotune's decisions on paper (`framework.plan.tune`): which layouts apply, which the cost model
rules out, which are skipped, which wins; and the paper plan against DeepSpeed's own estimators."""

from __future__ import annotations

import pytest
import torch

from framework.backend.estimate import model_facts
from framework.cli.autotune import why_chosen
from framework.errors import ConfigError
from framework.models import GPT, MLP
from framework.plan import paper, tune
from framework.plan.cost import model_state_bytes, param_counts
from framework.plan.strategy import Strategy
from framework.plan.tune import Layout, ModelFacts, Trial

FACTS = ModelFacts(parameters=1_000_000, largest_parameter=65_536, recomputable=True, tp_degrees=(1, 2))


def test_candidates_keep_the_global_batch_and_only_what_applies():
    """Every candidate lays out the same global batch; offload needs a device and a stage >= 1,
    recompute a model with blocks, tensor parallelism a plan; knobs left out keep the strategy's."""
    layouts = tune.candidates(Strategy(), FACTS, world_size=2, global_batch=32)
    assert len(layouts) == 4 * 3 * 2 * 2  # stages x micro-batches x recompute x TP degrees
    for layout in layouts:
        micro = tune.micro_batch(layout, Strategy(), 2, 32)
        assert micro * layout.accumulation * (2 // layout.tensor_parallel) == 32
        assert not layout.offload
    with_offload = tune.candidates(Strategy(), FACTS, 2, 32, ["stage", "offload"], offload_possible=True)
    assert {(lay.stage, lay.offload) for lay in with_offload} == {(0, False)} | {
        (s, o) for s in (1, 2, 3) for o in (False, True)
    }
    mlp = model_facts(MLP(), Strategy(), torch.optim.Adam, 2)
    only_stage = tune.candidates(Strategy(gradient_merge={"k_steps": 2}), mlp, 2, 32, ["stage"])
    assert [(lay.stage, lay.accumulation, lay.tensor_parallel) for lay in only_stage] == [
        (s, 2, 1) for s in range(4)
    ]
    # a batch that does not divide is no candidate: 6 over 2 ranks x 4 accumulation steps
    assert {lay.accumulation for lay in tune.candidates(Strategy(), FACTS, 2, 6, ["micro_batch"])} == {1}


def test_a_model_says_what_it_can_take():
    """The GPT has blocks and a tensor-parallel plan for degrees dividing its 4 heads."""
    facts = model_facts(GPT(), Strategy(), torch.optim.AdamW, world_size=8)
    assert facts.recomputable and facts.tp_degrees == (1, 2, 4)
    assert facts.parameters == param_counts(GPT())[0] and facts.optimizer_bytes_per_param == 8
    assert model_facts(MLP(), Strategy(), None, 8).tp_degrees == (1,)


def test_unknown_knobs_and_the_pipeline_are_one_line():
    with pytest.raises(
        ConfigError, match=r"autotune.space: unknown knob\(s\) \['stages'\]; choose from stage, "
    ):
        tune.candidates(Strategy(), FACTS, 2, 32, ["stages"])
    with pytest.raises(ConfigError, match="pipeline engine's layout"):
        tune.candidates(Strategy(pipeline={"stages": 2}), FACTS, 2, 32)


def test_overrides_pin_what_apply_sets():
    layout = Layout(stage=2, offload=True, accumulation=4, recompute=True, tensor_parallel=2)
    strategy = layout.apply(Strategy(amp={"enable": True}))
    assert Layout.of(strategy) == layout and strategy.amp.enable
    assert layout.overrides() == [
        "strategy.sharding.stage=2",
        "strategy.sharding.offload_optimizer=true",
        "strategy.gradient_merge.k_steps=4",
        "strategy.recompute.enable=true",
        "strategy.tensor_parallel.degree=2",
    ]
    assert layout.describe(micro_batch=4) == "ZeRO-2 + offload | micro 4 x 4 | recompute | TP 2"


def _trial(stage: int, estimated: float, **layout: object) -> Trial:
    return Trial(Layout(stage=stage, **layout), micro_batch=8, estimated_gb=estimated)  # type: ignore[arg-type]


def test_prune_skip_and_choose():
    """Over budget x margin on paper: pruned. The search walks the frontier: simplest first, and a
    layout that saves more memory in every knob than one that fits is skipped (exhaustive: tried);
    the fastest that fits wins, and within 3 % of it the simplest."""
    measured = {0: (5.0, 300.0), 1: (3.0, 100.0), 2: (2.5, 120.0), 3: (2.0, 90.0)}
    for exhaustive, tried, winner in ((False, [0, 1], 1), (True, [3, 2, 1, 0], 2)):  # exhaustive: as given
        trials = [
            _trial(3, 1.0),
            _trial(2, 1.0),
            _trial(1, 1.0),
            _trial(0, 1.0),
            _trial(1, 9.0, recompute=True),
        ]
        seen: list[int] = []

        def measure(trial: Trial, seen: list[int] = seen) -> tuple[float | None, float | None, str | None]:
            seen.append(trial.layout.stage)
            return (*measured[trial.layout.stage], None)

        lines: list[str] = []
        chosen = tune.run_search(trials, 4.0, 1.0, measure, show=lines.append, exhaustive=exhaustive)
        assert seen == tried and chosen is not None and chosen.layout.stage == winner, exhaustive
        by_stage = {t.layout.stage: t for t in trials if not t.layout.recompute}
        assert by_stage[0].status == "over budget" and not by_stage[0].fits
        pruned = next(t for t in trials if t.layout.recompute)
        assert pruned.status == "pruned: estimated 9 GB > 4 GB (budget x margin)"
        if not exhaustive:
            assert (
                by_stage[2].status
                == "skipped: saves more memory than ZeRO-1 | micro 8 x 1, which fits (no faster)"
            )
            assert [t.layout.stage for t in trials][:4] == [0, 1, 2, 3]  # left in the order tried
        assert len(lines) == (6 if exhaustive else 5)  # header, rows; skipped ones as one line
        if not exhaustive:
            assert (
                lines[-1]
                == "  2 layout(s) skipped: saves more memory than ZeRO-1 | micro 8 x 1, which fits (no faster)"
            )


def test_what_cannot_fit_is_skipped_and_ties_go_to_the_simpler():
    more = [_trial(2, 1.0, accumulation=2), _trial(1, 1.0, accumulation=2)]
    more[0].status = "over budget"
    assert tune.skip_dominated(more[1], [more[0]]) and more[1].status.startswith("skipped: holds at least")
    oom = _trial(3, 1.0)
    tune.record(oom, None, None, "OutOfMemoryError: CUDA out of memory", limit_gb=2.0)
    assert oom.status.startswith("over budget: ") and not oom.fits

    fast, simple = _trial(2, 1.0), _trial(1, 1.0)
    for trial, rate in ((fast, 102.0), (simple, 100.0)):
        tune.record(trial, 1.0, rate, None, limit_gb=2.0)
    assert tune.choose([fast, simple]) is simple  # within 3 %: the simpler, and the console says why
    why = why_chosen(simple, [fast, simple])
    assert why.startswith(f"within 2.0 % of the fastest, {fast.name} (102.0 samples/s), and simpler")
    fast.samples_per_s = 110.0
    assert tune.choose([fast, simple]) is fast
    assert why_chosen(fast, [fast, simple]) == "the fastest layout that fits"
    failed = _trial(0, 1.0)
    tune.record(failed, None, None, "ValueError: a shape", limit_gb=2.0)
    assert failed.status == "failed: ValueError: a shape" and tune.choose([failed]) is None


def test_a_budget_nothing_fits_is_one_line_with_what_would_get_there():
    trials = [_trial(3, 0.5), _trial(0, 0.9)]
    tune.prune(trials, budget_gb=0.25, margin=0.9)
    error = tune.nothing_fits(trials, 0.25, 0.9, offload_possible=False)
    text = str(error)
    assert "\n" not in text and "no layout fits 0.25 GB per rank" in text
    assert "smallest estimated need is 0.5 GB per rank (ZeRO-3 | micro 8 x 1)" in text
    assert "more ranks" in text


def test_report_has_the_keys_autotune_json_promises():
    chosen = _trial(1, 0.2)
    tune.record(chosen, 0.3, 42.0, None, limit_gb=1.0)
    report = tune.report(1.0, 0.9, chosen, [chosen])
    assert set(report) >= {"budget_gb", "chosen", "trials"}
    assert set(report["chosen"]) >= {"overrides", "peak_gb", "samples_per_s"}
    assert set(report["trials"][0]) >= {
        "overrides",
        "estimated_gb",
        "peak_gb",
        "samples_per_s",
        "fits",
        "status",
    }


# An 8 B and a 1 B Llama (the shapes of Llama 3), built on the meta device: no memory.
LLAMAS = {
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32),
}


@pytest.mark.parametrize("size,devices", [("8B", 64), ("8B", 8), ("1B", 8)])
def test_paper_plan_agrees_with_deepspeeds_estimators(size, devices):
    """Per-rank model states under bf16 + Adam, ZeRO-2 and ZeRO-3, within 10 % of DeepSpeed's
    `estimate_zero2/3_model_states_mem_needs_all_cold` (the figures those print, which leave
    buffers out: so does this comparison), for the 8 B Llama on 64 ranks of the paper plan and two
    more."""
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    config = transformers.LlamaConfig(num_key_value_heads=8, vocab_size=128256, **LLAMAS[size])
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    facts = model_facts(model, Strategy(), torch.optim.AdamW, devices)
    for stage in (2, 3):
        strategy = Strategy(sharding={"stage": stage}, amp={"enable": True, "dtype": "bf16"})
        ours = model_state_bytes(strategy, facts.parameters, facts.largest_parameter, devices)
        states = ours["peak_bytes"] - ours["buffer_bytes"]
        if stage == 2:
            _, theirs = estimate_zero2_model_states_mem_needs(facts.parameters, devices, 1, False, 1.0)
        else:
            _, theirs, _ = estimate_zero3_model_states_mem_needs(
                facts.parameters, facts.largest_parameter, devices, 1, False, False, True, 1.0
            )
        assert states == pytest.approx(theirs, rel=0.10), (size, devices, stage)


def test_the_paper_plan_ranks_what_fits_first():
    """An 8 B Llama in bf16 on 64 x 80 GB: ZeRO-0's 16 bytes per parameter do not fit on paper,
    ZeRO-1 (the simplest that does) comes first; on 64 x 10 GB only sharded or split layouts fit."""
    transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    config = transformers.LlamaConfig(num_key_value_heads=8, vocab_size=128256, **LLAMAS["8B"])
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    base = Strategy(amp={"enable": True})
    facts = model_facts(model, base, torch.optim.AdamW, 64)
    plan = paper.on_paper(base, facts, devices=64, memory_gb=80, margin=0.9, global_batch=512)
    zero0 = next(t for t in plan if t.layout == Layout(stage=0))
    assert not zero0.fits and zero0.status.startswith("over: ") and zero0.estimated_gb > 72
    assert plan[0].fits and plan[0].layout == Layout(stage=1) and plan[0].status == "fits on paper"
    small = paper.on_paper(base, facts, devices=64, memory_gb=10, margin=0.9, global_batch=512)
    assert small[0].fits and (small[0].layout.stage >= 2 or small[0].layout.tensor_parallel > 1)
    assert not next(t for t in small if t.layout == Layout(stage=1)).fits
    assert [t.fits for t in small] == sorted((t.fits for t in small), reverse=True)


def test_what_autotune_asks_of_a_model_names_the_real_blocker(monkeypatch):
    """A pipeline GPT (whose plan allows TP, which the pipeline does not take) and a Mixtral with
    expert parallelism: the model's facts are read under the strategy as given, without trying the
    tensor-parallel degree the user never asked for; what training would refuse is said first."""
    from tests.backend.test_expert_parallel import mixtral

    pipeline = Strategy(pipeline={"stages": 2})
    facts = model_facts(GPT(), pipeline, torch.optim.AdamW, world_size=2)
    assert facts.tp_split == 0
    with pytest.raises(ConfigError, match="pipeline engine's layout"):
        tune.check_searchable(pipeline)
    experts = Strategy(sharding={"stage": 1}, expert_parallel={"degree": 2})
    monkeypatch.setattr("transformers.__version__", "5.23.0")  # one AutoEP does not run with
    with pytest.raises(ConfigError, match="AutoEP runs with transformers .* 5.23.0 is installed"):
        model_facts(mixtral(4), experts, torch.optim.AdamW, world_size=2)
    monkeypatch.setattr("transformers.__version__", "5.22.2")
    assert model_facts(mixtral(4), experts, torch.optim.AdamW, world_size=2).tp_split == 0
