"""Tensor parallelism beside ZeRO: the mesh of ranks, its one-line errors, the plan a model's
linears split by, and exactness on real gloo groups (2 ranks: TP 2; 4 ranks: TP 2 x DP 2)
against a one-process reference."""

from __future__ import annotations

import re

import pytest
import torch

from framework import ConfigError, Engine, Strategy
from framework.backend.ds_config import deepspeed_config
from framework.backend.parallel import check_model, tp_plan_of
from framework.models import GPT, MLP, LMLoss
from framework.plan.cost import split_numel
from framework.plan.run_plan import Mesh, batch_layout, mesh_of
from framework.plan.strategy import parse_tp_style

from ..conftest import run_layout_script


def tiny_llama(heads: int = 4, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=16,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


# ---------------------------------------------------------------------------------------- the mesh


def test_mesh_coordinates_follow_deepspeeds_groups():
    """TP ranks are neighbours (DeepSpeed's (dp, tp) device mesh): ranks 0,1 are replica 0."""
    meshes = [mesh_of(Strategy(tensor_parallel={"degree": 2}), 4, rank) for rank in range(4)]
    assert [m.dp_size for m in meshes] == [2] * 4
    assert [m.dp_rank for m in meshes] == [0, 0, 1, 1]
    assert [m.mp_rank for m in meshes] == [0, 1, 0, 1]
    assert meshes[0].describe() == "4 rank(s) = 2 data-parallel x 2 tensor-parallel"
    pipe = mesh_of(Strategy(pipeline={"stages": 2}), 4, 3)  # stages outermost
    assert (pipe.dp_size, pipe.dp_rank) == (2, 1)
    ep = mesh_of(Strategy(expert_parallel={"degree": 2}), 4)
    assert ep.dp_size == 4 and "experts over 2 ranks" in ep.describe()


def test_a_global_batch_splits_over_the_data_parallel_ranks_left():
    layout = batch_layout(Strategy(tensor_parallel={"degree": 2}, gradient_merge={"k_steps": 2}), 8, 4)
    assert (layout.data_parallel_size, layout.micro_batch_size) == (2, 2)


@pytest.mark.parametrize(
    "strategy, world, message",
    [
        ({"tensor_parallel": {"degree": 2}}, 3, "tensor_parallel.degree=2 does not divide the 3 processes"),
        ({"sequence_parallel": {"degree": 4}}, 2, "sequence_parallel.degree=4 does not divide the 2"),
        ({"expert_parallel": {"degree": 3}}, 4, "expert_parallel.degree=3 does not divide the 4"),
    ],
)
def test_degrees_that_do_not_divide_the_processes_are_one_line_errors(strategy, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        mesh_of(Strategy(**strategy), world)


@pytest.mark.parametrize(
    "strategy, message",
    [
        ({"tensor_parallel": {"degree": 2}, "pipeline": {"stages": 2}}, "cannot run with the pipeline"),
        (
            {"tensor_parallel": {"degree": 2}, "sequence_parallel": {"degree": 2}},
            "together are not supported",
        ),
        ({"tensor_parallel": {"degree": 0}}, "must be a whole number >= 1"),
        (
            {"tensor_parallel": {"degree": 2, "plan": {"blocks.*.qkv": "diagonal"}}},
            "not a tensor-parallel style",
        ),
        ({"tensor_parallel": {"degre": 2}}, "unknown key(s) ['degre'] in strategy.tensor_parallel"),
    ],
)
def test_combinations_that_cannot_run_are_one_line_errors(strategy, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Strategy(**strategy)


def test_the_model_must_divide_by_the_degree():
    mesh = Mesh(world_size=4, rank=0, tp_size=4)
    strategy = Strategy(tensor_parallel={"degree": 4})
    with pytest.raises(
        ConfigError, match=re.escape("degree=4 does not divide the model's 2 key-value heads")
    ):
        check_model(strategy, mesh, tiny_llama(heads=4, kv_heads=2))
    with pytest.raises(ConfigError, match=re.escape("does not divide the model's 2 attention heads")):
        check_model(strategy, mesh, GPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
    check_model(strategy, mesh, tiny_llama(heads=4, kv_heads=4))
    with pytest.raises(ConfigError, match="no mixture-of-experts layers"):
        check_model(Strategy(expert_parallel={"degree": 2}), Mesh(2, 0, ep_size=2), tiny_llama())


# ---------------------------------------------------------------------------------------- the plan


def test_a_plan_becomes_deepspeeds_layer_specs():
    strategy = Strategy(tensor_parallel={"degree": 2})
    plan = tp_plan_of(strategy, GPT())
    ds = deepspeed_config(strategy, batch_layout(strategy, 4, 2), tp_plan=plan)
    specs = ds["tensor_parallel"]["partition_config"]["layer_specs"]
    (proj,) = [s for s in specs if re.match(s["patterns"][0], "blocks.3.proj.weight")]
    assert proj["partition_type"] == "row"
    assert not any(re.match(s["patterns"][0], "blocks.3.proj_extra.weight") for s in specs)
    (fused,) = [s for s in specs if "shape" in s]  # q, k, v in one linear: 3 parts split alike
    assert (fused["shape"], fused["partition_type"]) == ([3, -1], "column")
    assert parse_tp_style("x", "colwise") == ("column", 1)  # Hugging Face's spelling
    user = Strategy(
        tensor_parallel={"degree": 2, "plan": {"net.0": "column", "net.2": "row", "head": "replicate"}}
    )
    assert tp_plan_of(user, MLP()) == {"net.0": "column", "net.2": "row", "head": "replicate"}


def test_a_model_without_a_plan_is_told_how_to_give_one():
    with pytest.raises(ConfigError, match="says nothing of how its linears split"):
        tp_plan_of(Strategy(tensor_parallel={"degree": 2}), MLP())
    assert tp_plan_of(Strategy(tensor_parallel={"degree": 2}), tiny_llama()) is None  # its own tp_plan


def test_the_memory_estimate_counts_a_ranks_share():
    """Measured shares (this rank's parameter elements / the model's at TP 2, ZeRO 0-2) come from
    the exactness run; the estimate counts the split linears at 1/2 and stays within 10 %."""
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    tp2 = Engine(
        model,
        LMLoss(),
        torch.optim.AdamW,
        strategy=Strategy(sharding={"stage": 1}, tensor_parallel={"degree": 2}),
    )
    whole = Engine(model, LMLoss(), torch.optim.AdamW, strategy=Strategy(sharding={"stage": 1}))
    cost, base = tp2.cost("train", world_size=4), whole.cost("train", world_size=4)
    assert cost["data_parallel_size"] == 2 and base["data_parallel_size"] == 4
    assert cost["parameters_per_rank"] / cost["parameters"] == pytest.approx(0.5537, rel=0.1)
    assert cost["params_bytes"] < base["params_bytes"]
    tp_split, _ = split_numel(tiny_llama(), Strategy(tensor_parallel={"degree": 2}))
    assert 0 < tp_split < sum(p.numel() for p in tiny_llama().parameters())


# ---------------------------------------------------------------------------------------- exactness


@pytest.mark.slow
def test_tensor_parallel_is_exact_on_two_ranks(tmp_path):
    """TP 2 x ZeRO 0-3 x accumulation 1/2 x (fit, run), the GPT (its own plan, fused q/k/v), a
    Llama (its Hugging Face tp_plan) and an MLP split by the strategy's plan: one SGD step on
    padded sequences gives the one-process weights and loss; each rank holds about half the
    split weights (ZeRO 0-2); `predict` gives every sample's outputs once, in dataset order (not
    once per tensor-parallel rank)."""
    results = run_layout_script(tmp_path, "gpt,llama,mlp", "tp2", "0,1,2,3", "1,2", "fit,run,predict")
    assert len(results[0]["errors"]) == 3 * (4 * 2 * 2 + 1)  # + predict: the outputs of each sample, once
    for case, share in results[0]["shares"].items():
        if "zero3" not in case:
            assert 0.5 < share < 0.6, (case, share)  # split linears halved; embeddings and norms whole


@pytest.mark.slow
def test_tensor_and_data_parallel_on_four_ranks(tmp_path):
    """TP 2 x DP 2: the two replicas take different halves of the global batch."""
    results = run_layout_script(tmp_path, "gpt,llama", "tp2", "1,3", "2", "fit", ranks=4)
    assert len(results[0]["errors"]) == 2 * 2


def test_a_plan_is_checked_against_the_model_before_deepspeed_is_built():
    """A plan entry that matches nothing (all of them, or one misspelt name whose partner alone
    would split: `mat1 and mat2 shapes cannot be multiplied`) and a split the degree does not
    divide are one line each, naming the entry; a plan that fits passes."""
    mesh, model = Mesh(2, 0, tp_size=2), MLP(in_features=8, hidden=[32, 33], num_classes=4)

    def check(plan):
        check_model(Strategy(tensor_parallel={"degree": 2, "plan": plan}), mesh, model)

    check({"features.0": "column", "features.2": "row", "head": "replicate"})
    with pytest.raises(ConfigError, match=r"plan\['blocks.\*.fc'\] matches no module of MLP .*features.0"):
        check({"blocks.*.fc": "column", "blocks.*.proj": "row"})
    with pytest.raises(ConfigError, match=r"plan\['feature.2'\] matches no module"):
        check({"features.0": "column", "feature.2": "row"})
    with pytest.raises(ConfigError, match="features.2 has 33 outputs, which degree 2 does not divide"):
        check({"features.2": "column", "head": "row"})
    with pytest.raises(ConfigError, match="head has 33 inputs"):
        check({"features.2": "replicate", "head": "row"})
