"""Adapters (`framework.integrations.peft`, the builder's adapt step, `export --adapter / --hf`):
LoRA under every ZeRO stage x accumulation on 2 ranks equals a plain PyTorch + PEFT loop on one
process, and what it exports loads in PEFT and transformers."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from framework import ConfigError, Engine, Strategy
from framework.engine import construct
from framework.export import fp32_state_dict
from framework.export import main as export
from framework.integrations import hf, peft_files
from framework.integrations import peft as adapters

from ..conftest import ROOT, run_cmd, torchrun
from ..helpers.tiny_chat import random_lora

peft = pytest.importorskip("peft", reason="needs the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def lora(**kwargs):
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", **kwargs)


# ------------------------------------------------------------------------------------- in process


def test_a_peft_wrapper_is_seen_through_for_the_label_shift_and_the_config():
    model = adapters.adapt(tiny_llama(), lora(), causal_lm=True)
    assert adapters.is_adapted(model) and hf.predicts_next_token(model)
    prefix, inner = hf.hf_model_in(model)
    assert prefix == "base_model.model." and type(inner).__name__ == "LlamaForCausalLM"
    assert all(k.startswith(prefix) for k in model.state_dict())


def test_the_console_line_says_what_trains():
    model = adapters.adapt(tiny_llama(), lora(), causal_lm=True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    linears = [
        m for n, m in tiny_llama().named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ]
    assert len(linears) == 14 and trainable == sum(4 * (m.in_features + m.out_features) for m in linears)
    line = adapters.describe(model)
    assert line.startswith("LoRA r=4 on 14 modules: ") and f"{trainable:,} of " in line
    dora = adapters.adapt(tiny_llama(), lora(use_dora=True), causal_lm=True)
    assert adapters.describe(dora).startswith("DoRA r=4 on 14 modules")


@pytest.mark.parametrize(
    "strategy, words",
    [
        ({"pipeline": {"stages": 2}}, "strategy.pipeline.stages=1"),
        ({"tensor_parallel": {"degree": 2}}, "strategy.tensor_parallel.degree=1"),
        ({"sequence_parallel": {"degree": 2}}, "strategy.sequence_parallel.degree=1"),
        ({"expert_parallel": {"degree": 2}}, "strategy.expert_parallel.degree=1"),
    ],
)
def test_parallelisms_adapters_do_not_support_are_refused_in_one_line(strategy, words):
    with pytest.raises(ConfigError, match=words):
        construct.check_adapted(Strategy(**strategy))
    with pytest.raises(ConfigError, match=words):
        Engine(tiny_llama(), "model", strategy=strategy, adapter=lora())


def test_an_adapter_on_an_adapted_model_is_refused():
    with pytest.raises(ConfigError, match="already carries an adapter"):
        Engine(adapters.adapt(tiny_llama(), lora()), "model", adapter=lora())


def test_modules_to_save_that_name_no_module_are_refused_in_one_line():
    """peft wraps the modules whose names end with a `modules_to_save` entry and says nothing
    when none does: a misspelt `lm_head` trained only the adapters, as if it were copied and
    trained whole. Refused as a target module matching nothing is, naming the nearest module."""
    with pytest.raises(ConfigError) as error:
        adapters.adapt(tiny_llama(), lora(modules_to_save=["lm_head", "lm_haed"]), causal_lm=True)
    line = str(error.value)
    assert line.startswith(
        "adapter: modules_to_save ['lm_haed'] not found in the base model (LlamaForCausalLM)"
    )
    assert "e.g. lm_head" in line and "\n" not in line
    with pytest.raises(ConfigError, match="modules_to_save"):
        Engine(tiny_llama(), "model", adapter=adapters.AdapterConfig(modules_to_save=["score"]))
    saved = adapters.adapt(tiny_llama(), lora(modules_to_save=["lm_head"]), causal_lm=True)
    assert any("lm_head.modules_to_save" in n for n, p in saved.named_parameters() if p.requires_grad)


def test_the_builder_adapts_what_the_factory_builds_and_only_the_adapter_trains():
    from framework.backend.runtime import Runtime

    runtime = Runtime(Strategy(sharding={"stage": 0}))
    model = construct.build_model(tiny_llama, runtime, adapter=lora(modules_to_save=["lm_head"]))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or "modules_to_save" in n for n in trained)
    engine = Engine(model, "model", functools.partial(torch.optim.SGD, lr=0.1), runtime=runtime)
    engine.prepare("train", 2)
    held = {id(p) for group in engine.runtime.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}
    engine.close()


# ------------------------------------------------------------------------------------- 2 ranks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    """tests/scripts/lora_invariance.py on 2 ranks (every stage x accumulation 1, 2, plus a
    user-wrapped model, modules_to_save and recompute): its results and output dir."""
    out = tmp_path_factory.mktemp("lora")
    script = str(ROOT / "tests" / "scripts" / "lora_invariance.py")
    run = run_cmd([*torchrun(2), script, str(out)], timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_lora_under_every_stage_and_accumulation_equals_plain_peft(two_ranks):
    """3 SGD steps on 2 ranks: adapters, frozen base, logged losses, grad_norms and counted tokens
    equal one process of plain PyTorch + PEFT (fp32); the optimizer holds the adapter's
    parameters only; lora_B trained (non-zero)."""
    _, results = two_ranks
    for result in results:
        assert len(result["errors"]) == 4 * 2 + 3
        bad = {
            case: e for case, e in result["errors"].items() if not all(x <= 1e-6 for x in e)
        }  # NaN: missing
        assert not bad, bad
        for case, (held, trainable) in result["optimizer"].items():
            assert trainable in (4096, 4096 + 64 * 32), case  # the adapters (and lm_head when saved)
            if not case.startswith(("zero3", "wrapped", "modules_to_save", "recompute zero3")):
                assert held == trainable, case
        assert min(result["lora_b"].values()) > 1e-3
        for case, share in result["frozen_share"].items():  # ZeRO-3 partitions the frozen base too
            assert share < 0.6 if "zero3" in case else share == 1.0, (case, share)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_export_adapter_loads_in_peft_and_merged_gives_its_logits(two_ranks, tmp_path, stage):
    """From a ZeRO-0 and a 2-rank ZeRO-3 checkpoint (which hold what trains, not the frozen base):
    --adapter writes what PeftModel loads (lora_B non-zero, the file a fraction of the base's),
    --hf the merged model with the same logits."""
    out, _ = two_ranks
    ckpt = out / f"ckpt-zero{stage}"
    base = ["--base", str(out / "base")]  # the checkpoint holds what trained: the base comes from its dir
    assert export([str(ckpt), str(tmp_path / "adapter"), "--adapter", *base]) == 0
    assert export([str(ckpt), str(tmp_path / "merged"), "--hf", *base]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base")
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    state = adapted.state_dict()
    assert max(v.abs().max().item() for k, v in state.items() if "lora_B" in k) > 1e-3
    size = (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size
    base_size = (out / "base" / "model.safetensors").stat().st_size
    assert size < 0.25 * base_size
    held = fp32_state_dict(ckpt)  # what trains, never the frozen base
    assert held and all("lora_" in k for k in held if k.endswith("weight")), sorted(held)[:5]
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = adapted(input_ids=tokens).logits, merged(input_ids=tokens).logits
    assert (want - got).abs().max().item() < 1e-4


def test_modules_to_save_on_a_model_built_partitioned_is_refused_in_one_line():
    """peft copies a `modules_to_save` module whole: from a model born inside zero.Init it would
    copy empty partitions (DeepSpeed 7669). Built whole (the default for a model that fits) it
    trains: tests/scripts/lora_invariance.py's ZeRO-3 case."""
    from framework.backend.runtime import Runtime

    runtime = Runtime(Strategy(sharding={"stage": 3, "init": "partitioned"}))
    runtime.fix_layout(2)
    config = tiny_llama().config
    with pytest.raises(ConfigError, match="strategy.sharding.init=whole"):
        construct.build_model(
            lambda: transformers.LlamaForCausalLM._from_config(config),
            runtime,
            adapter=lora(modules_to_save=["lm_head"]),
            transformers=True,
        )


@pytest.mark.slow
def test_lora_on_one_process_equals_plain_peft(tmp_path, monkeypatch):
    """The same script on one process (in this one): ZeRO-0 and ZeRO-3 with accumulation 2."""
    import runpy

    script = ROOT / "tests" / "scripts" / "lora_invariance.py"
    monkeypatch.setattr("sys.argv", [str(script), str(tmp_path), "0,3", "2", "none"])
    runpy.run_path(str(script), run_name="__main__")
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert sorted(result["errors"]) == ["zero0 acc2", "zero3 acc2"]
    bad = {case: e for case, e in result["errors"].items() if not all(x <= 1e-6 for x in e)}
    assert not bad, bad


def test_peft_asks_nothing_deprecated_of_a_transformers_model():
    """peft reads `is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning on
    every run and export: the framework's adapt and rebuild never show it."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapted = adapters.adapt(tiny_llama(), lora(), causal_lm=True)
        peft_files.rebuilt(tiny_llama(), lora(task_type="CAUSAL_LM"), adapted.state_dict())
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]


@pytest.mark.slow
def test_lora_on_a_plain_torch_module_saves_a_complete_checkpoint_and_exports_for_peft(tmp_path):
    """`python train.py +adapter=lora` on the default MLP (not a transformers model): the end-of-run
    checkpoint is complete, and `export --adapter` writes what PEFT loads onto an MLP."""
    from framework.checkpoint import store
    from framework.models import MLP

    from ..conftest import FAST, run_train

    run = run_train(["+adapter=lora", *FAST], tmp_path / "run")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    path = store.find_resumable(tmp_path / "run" / "checkpoints")
    assert path is not None and store.read_meta(path)["reason"] == "end"
    assert export([str(path), str(tmp_path / "adapter"), "--adapter"]) == 0
    adapted = peft.PeftModel.from_pretrained(MLP(), tmp_path / "adapter")
    held, loaded = fp32_state_dict(path), adapted.state_dict()
    assert held and all(torch.equal(loaded[k], v) for k, v in held.items())
    assert max(v.abs().max().item() for k, v in held.items() if "lora_B" in k) > 0  # trained


def _lora_head(**extra):
    return random_lora(
        tiny_llama(), r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "lm_head"], **extra
    )


def test_a_lora_head_is_its_base_layer_and_low_rank_terms():
    """head(x) = layer(x) + F.linear(down(x), up) for a LoRA head; off or merged, the base layer
    alone; a modules_to_save copy is the copy that runs; DoRA on the head is not known (None)."""
    x = torch.randn(5, 32)
    model = _lora_head()
    head = model.get_output_embeddings()
    layer, terms = adapters.head_terms(head)
    assert type(layer) is torch.nn.Linear and len(terms) == 1
    down, up = terms[0]
    with torch.no_grad():
        assert torch.allclose(layer(x) + torch.nn.functional.linear(down(x), up), head(x), atol=1e-6)
        with model.disable_adapter():
            assert adapters.head_terms(head) == (layer, [])
    plain = tiny_llama()
    assert adapters.head_terms(plain.lm_head) == (plain.lm_head, [])
    saved = peft.get_peft_model(tiny_llama(), lora(modules_to_save=["lm_head"]))
    copy_, terms = adapters.head_terms(saved.get_output_embeddings())
    assert terms == [] and copy_ is saved.get_output_embeddings().modules_to_save["default"]
    assert adapters.head_terms(_lora_head(use_dora=True).get_output_embeddings()) is None
