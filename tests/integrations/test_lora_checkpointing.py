"""LoRA under ZeRO-3 with activation checkpointing turned on as users turn it on: transformers'
`gradient_checkpointing_enable` (reentrant and not) on the model before the framework adapts it,
on a model the user wrapped with peft first, and the framework's `strategy.recompute`. Every
`lora_B` gets its gradient on the first step (the update equals plain PEFT's without
checkpointing), the layers are really recomputed, and a checkpoint saved mid-run resumes to the
uninterrupted run's adapters (TRL issue 2514). One process, in this one."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch

from framework import Engine, Strategy
from framework.checkpoint import store

from ..conftest import end_group

peft = pytest.importorskip("peft", reason="needs the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

T, V, LR = 16, 64, 0.5
HOW = ["hf reentrant", "hf non-reentrant", "peft-wrapped, hf reentrant", "strategy.recompute"]


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
    )
    tokens = torch.randint(0, V, (8, T))
    return transformers.LlamaForCausalLM(config), [{"input_ids": t, "labels": t} for t in tokens]


def lora():
    return peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )


def engine_for(base, how: str | None, stage: int = 3) -> tuple[Engine, list[int]]:
    """An Engine training LoRA on a copy of `base`, checkpointing turned on `how` (None: off), and
    the count of the layers' MLP calls (a recomputed layer runs them twice per step)."""
    torch.manual_seed(1)  # the adapters' initialisation
    model, adapter, recompute = copy.deepcopy(base), lora(), False
    if how and how.startswith("peft-wrapped"):
        model, adapter = peft.get_peft_model(model, adapter), None
    if how and "hf" in how:
        with warnings.catch_warnings():  # transformers 5 renames it; users still call this name
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": "non-" not in how}
            )
    recompute = how == "strategy.recompute"
    calls = [0]
    for layer in (m for m in model.modules() if type(m).__name__ == "LlamaMLP"):
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    engine = Engine(
        model,
        "model",
        functools.partial(torch.optim.SGD, lr=LR),
        adapter=adapter,
        strategy=Strategy(sharding={"stage": stage}, recompute={"enable": recompute}),
    )
    return engine, calls


def adapters(engine: Engine) -> dict[str, torch.Tensor]:
    state = engine.runtime.full_state_dict(on_every_rank=True)
    return {k: v.detach().clone() for k, v in state.items() if "lora_" in k}


def train(model, data, how, steps, **fit):
    engine, calls = engine_for(model, how)
    engine.fit(data, batch_size=4, max_steps=steps, shuffle=False, progress=False, **fit)
    out = adapters(engine), calls[0]
    engine.close()
    end_group()
    return out


@pytest.fixture(scope="module")
def plain(base):
    """Plain PEFT's first step, ZeRO-0, no checkpointing."""
    engine, _ = engine_for(base[0], None, stage=0)
    engine.fit(base[1], batch_size=4, max_steps=1, shuffle=False, progress=False)
    out = adapters(engine)
    engine.close()
    end_group()
    return out


@pytest.mark.parametrize("how", HOW)
def test_every_lora_b_gets_its_gradient_on_the_first_step(base, plain, how):
    model, data = base
    engine, calls = engine_for(model, how)
    engine.fit(data, batch_size=4, max_steps=1, shuffle=False, progress=False)
    got = adapters(engine)
    engine.close()
    end_group()
    assert calls[0] == 2 * 2  # two layers, each run again in backward: the checkpointing is on
    b = {k: v for k, v in got.items() if "lora_B" in k}
    assert len(b) == 14 and all(v.abs().max() > 0 for v in b.values()), [
        k for k, v in b.items() if not v.any()
    ]
    assert got.keys() == plain.keys()
    for key, value in plain.items():  # SGD from lora_B = 0: the step is the gradient, equal to PEFT's
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=0, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["hf reentrant", "hf non-reentrant"])
def test_a_checkpoint_saved_mid_run_resumes_to_the_uninterrupted_adapters(base, tmp_path, how):
    model, data = base
    whole, _ = train(model, data, how, 2, save_dir=str(tmp_path / "whole"), save_freq=1)
    first = store.find_resumable(tmp_path / "whole")
    assert first is not None
    saved = sorted(p for p in (tmp_path / "whole").iterdir() if p.name.startswith("step_"))[0]
    resumed, calls = train(model, data, how, 2, save_dir=str(tmp_path / "resumed"), resume=str(saved))
    assert calls == 2 * 2  # one step after the resume (two layers), each recomputed
    for key, value in whole.items():
        torch.testing.assert_close(resumed[key], value, atol=1e-6, rtol=0, msg=key)
