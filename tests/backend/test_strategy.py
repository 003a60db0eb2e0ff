"""The Strategy -> DeepSpeed config adapter: a pure function, tested for every conf/strategy file."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from framework.backend.ds_config import deepspeed_config
from framework.errors import ConfigError
from framework.plan.cost import auto_sizes
from framework.plan.run_plan import batch_layout
from framework.plan.strategy import Amp, Sharding, Strategy

from ..conftest import CONF


def config_for(strategy, global_batch_size, world_size, num_params=0, largest_param=0):
    """The DeepSpeed config for this global batch on this many processes."""
    layout = batch_layout(strategy, global_batch_size, world_size)
    return deepspeed_config(strategy, layout, num_params, largest_param)


STRATEGY_FILES = sorted(p.stem for p in (CONF / "strategy").glob("*.yaml"))

# What each shipped strategy must turn into (the keys that decide behaviour).
EXPECTED = {
    "zero0": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero3_offload": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "offload_param": {"device": "cpu", "pin_memory": False},
    },
}


def _from_file(name: str) -> Strategy:
    node = OmegaConf.merge(OmegaConf.structured(Strategy), OmegaConf.load(CONF / "strategy" / f"{name}.yaml"))
    return Strategy.from_config(OmegaConf.to_container(node, resolve=True))


MODEL_PARALLEL = {  # file -> the DeepSpeed sections its degree must turn into
    "tp2": {"tensor_parallel": {"autotp_size": 2}},
    "sp2": {"sequence_parallel_size": 2},
    "ep2": {"expert_parallel": {"enabled": True, "autoep_size": 2}},
}


def test_every_strategy_file_is_covered():
    assert set(EXPECTED) | set(MODEL_PARALLEL) | {"pipeline"} == set(STRATEGY_FILES)


@pytest.mark.parametrize("name", sorted(MODEL_PARALLEL))
def test_model_parallel_files_to_deepspeed_config(name):
    """On 4 processes a degree of 2 leaves 2 data-parallel ranks: the batch triple counts those."""
    ds = config_for(_from_file(name), global_batch_size=8, world_size=4)
    for key, value in MODEL_PARALLEL[name].items():
        assert ds[key] == value
    expected_micro = 2 if name == "ep2" else 4  # experts split inside the data-parallel ranks
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]) == (8, expected_micro)
    assert ds["zero_optimization"]["stage"] == 1


def test_pipeline_file_to_deepspeed_config():
    strategy = _from_file("pipeline")
    assert strategy.uses_pipeline and strategy.pipeline.stages == 2
    ds = config_for(strategy, global_batch_size=32, world_size=2)  # 2 stages x 1 data-parallel rank
    assert (
        ds["train_batch_size"],
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
    ) == (32, 8, 4)
    assert ds["zero_optimization"]["stage"] == 0
    ds = config_for(strategy, global_batch_size=32, world_size=4)  # 2 stages x 2 data-parallel ranks
    assert ds["train_micro_batch_size_per_gpu"] == 4


@pytest.mark.parametrize("name", [n for n in STRATEGY_FILES if n in EXPECTED])
def test_strategy_file_to_deepspeed_config(name):
    ds = config_for(
        _from_file(name), global_batch_size=64, world_size=2, num_params=10_000, largest_param=4_096
    )
    assert ds["train_batch_size"] == 64
    assert ds["train_micro_batch_size_per_gpu"] == 32
    assert ds["gradient_accumulation_steps"] == 1
    for key, value in EXPECTED[name].items():
        assert ds["zero_optimization"][key] == value
    if EXPECTED[name]["stage"] == 0:
        assert set(ds["zero_optimization"]) == {"stage"}
    assert "bf16" not in ds and "fp16" not in ds


def test_batch_triple_with_accumulation():
    s = Strategy(sharding={"stage": 2}, gradient_merge={"k_steps": 4})
    ds = config_for(s, global_batch_size=128, world_size=2)
    assert (
        ds["train_batch_size"],
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
    ) == (128, 16, 4)


def test_uneven_global_batch_is_a_clear_error():
    s = Strategy(gradient_merge={"k_steps": 4})
    with pytest.raises(ConfigError) as err:
        batch_layout(s, global_batch_size=100, world_size=2)
    msg = str(err.value)
    assert "100" in msg and "2 data-parallel" in msg and "4 accumulation" in msg and "multiple of 8" in msg
    assert "96" in msg and "104" in msg


def test_sections_from_dicts_or_dataclasses_are_equal():
    a = Strategy(sharding={"stage": 3}, amp={"enable": True, "dtype": "bf16"})
    b = Strategy(sharding=Sharding(stage=3), amp=Amp(enable=True, dtype="bf16"))
    assert a == b
    ds = config_for(a, 8, 1)
    assert ds["bf16"] == {"enabled": True}


def test_fp16_section_has_dynamic_loss_scaling():
    ds = config_for(Strategy(amp={"enable": True, "dtype": "fp16"}), 8, 1)
    assert ds["fp16"]["enabled"] is True and ds["fp16"]["loss_scale"] == 0


def test_raw_deepspeed_dict_is_merged_last():
    s = Strategy(
        sharding={"stage": 2},
        deepspeed={"zero_optimization": {"overlap_comm": True}, "prescale_gradients": True},
    )
    ds = config_for(s, 8, 1)
    assert ds["zero_optimization"]["overlap_comm"] is True
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["prescale_gradients"] is True


def test_named_adam_optimizer_avoids_fused_adam_jit():
    s = Strategy(deepspeed={"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert config_for(s, 8, 1)["optimizer"]["params"] == {"lr": 1e-3, "torch_adam": True}


def test_gradient_clipping_is_off_unless_asked():
    """DeepSpeed's own default clips at 1.0; ours is off (0.0) unless the strategy asks."""
    assert config_for(Strategy(), 8, 1)["gradient_clipping"] == 0.0
    assert config_for(Strategy(gradient_clip={"max_norm": 0.5}), 8, 1)["gradient_clipping"] == 0.5


def test_deepspeeds_syncing_throughput_timer_is_off_unless_asked():
    off = {"throughput": {"enabled": False, "synchronized": False}}
    assert config_for(Strategy(), 8, 1)["timers"] == off
    asked = Strategy(deepspeed={"timers": {"throughput": {"enabled": True}}})
    assert config_for(asked, 8, 1)["timers"] == {"throughput": {"enabled": True}}  # DeepSpeed's defaults


def test_recompute():
    ds = config_for(Strategy(recompute={"enable": True}), 8, 1)
    assert ds["activation_checkpointing"]["cpu_checkpointing"] is False


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"sharding": {"stage": 4}}, ["stage=4", "0, 1, 2 or 3"]),
        ({"sharding": {"stage": 2, "offload_params": True}}, ["offload_params", "stage 3"]),
        ({"sharding": {"stage": 0, "offload_optimizer": True}}, ["offload_optimizer", "stage 1, 2 or 3"]),
        (
            {"sharding": {"stage": 2, "allgather_bucket_size": 1001}},
            ["allgather_bucket_size=1001", "use 1002"],
        ),
        ({"amp": {"enable": True, "dtype": "fp8"}}, ["fp8", "bf16 or fp16"]),
        ({"pipeline": {"stages": 2}, "sharding": {"stage": 3}}, ["pipeline", "ZeRO stage 3", "0 and 1"]),
        ({"sharding": {"stagee": 3}}, ["stagee", "valid keys"]),
    ],
)
def test_invalid_strategies_say_what_to_write(kwargs, words):
    with pytest.raises(ConfigError) as err:
        Strategy(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_pipeline_stages_must_divide_world_size():
    with pytest.raises(ConfigError, match="stages=2 does not divide the 3 processes"):
        batch_layout(Strategy(pipeline={"stages": 2}), 8, world_size=3)


def test_auto_sizes_follow_the_documented_rule():
    small = auto_sizes(num_params=26_122, largest_param=16_384)
    assert small == {  # the 1e5 floor, rounded up to a multiple of 64
        "reduce_bucket_size": 100_032,
        "allgather_bucket_size": 100_032,
        "prefetch_bucket_size": 100_032,
        "param_persistence_threshold": 1_280,
        "max_live_parameters": 200_064,
        "max_reuse_distance": 100_032,
        "sub_group_size": 100_032,
    }
    big = auto_sizes(num_params=30_400_000, largest_param=4096 * 4096)
    assert big["reduce_bucket_size"] == big["allgather_bucket_size"] == 3_800_000  # P / 8 < L
    assert big["prefetch_bucket_size"] == 4096 * 4096
    assert big["param_persistence_threshold"] == 40_960
    assert big["max_live_parameters"] == 2 * 4096 * 4096  # two of the largest layers at a time
    assert big["max_reuse_distance"] == 4096 * 4096  # DeepSpeed's 1e9 would keep all 30 M gathered
    assert big["sub_group_size"] == 7_600_000


def test_auto_values_reach_the_zero3_config_and_user_values_win():
    ds = config_for(Strategy(sharding={"stage": 3}), 8, 1, num_params=30_400_000, largest_param=4096 * 4096)
    z = ds["zero_optimization"]
    assert z["reduce_bucket_size"] == 3_800_000 and z["stage3_prefetch_bucket_size"] == 4096 * 4096
    user = Strategy(sharding={"stage": 3, "reduce_bucket_size": 1234, "max_live_parameters": 999})
    z = config_for(user, 8, 1, num_params=30_400_000, largest_param=4096 * 4096)["zero_optimization"]
    assert z["reduce_bucket_size"] == 1234 and z["stage3_max_live_parameters"] == 999
    assert z["stage3_max_reuse_distance"] == 4096 * 4096  # still auto: not tied to max_live
    assert z["allgather_bucket_size"] == 3_800_000


def test_config_is_pure():
    s = Strategy(sharding={"stage": 3}, deepspeed={"zero_optimization": {"overlap_comm": True}})
    first = config_for(s, 16, 2, 1000, 100)
    first["zero_optimization"]["stage"] = 99
    assert config_for(s, 16, 2, 1000, 100)["zero_optimization"]["stage"] == 3
    assert s.deepspeed == {"zero_optimization": {"overlap_comm": True}}


def test_host_only_strategy_drops_offload_and_keeps_the_rest():
    s = Strategy(
        sharding={"stage": 3, "offload_optimizer": True, "offload_params": True}, amp={"enable": True}
    )
    host = s.for_host_only()
    assert (host.sharding.offload_optimizer, host.sharding.offload_params) == (False, False)
    assert host.sharding.stage == 3 and host.amp.enable
    assert s.sharding.offload_optimizer  # the original is not changed
    assert "offload" not in json.dumps(config_for(host, 8, 1))
    plain = Strategy(sharding={"stage": 2})
    assert plain.for_host_only() is plain


def test_zero3_prefetch_and_live_parameters_hold_whole_transformer_blocks():
    """A transformer's block is larger than its largest tensor: ZeRO-3 prefetches a block and
    keeps about two of them gathered."""
    from framework.models import GPT
    from framework.plan.cost import largest_block

    model = GPT(n_layer=2, n_embd=256, n_head=4)
    block = largest_block(model)
    assert block == sum(p.numel() for p in model.blocks[0].parameters())
    sizes = auto_sizes(sum(p.numel() for p in model.parameters()), 4 * 256 * 256, block)
    assert sizes["prefetch_bucket_size"] >= block and sizes["max_live_parameters"] >= 2 * block


def test_offload_on_a_gpu_without_ninja_keeps_the_torch_optimizer_and_says_why(monkeypatch, capsys):
    import functools
    import shutil

    import torch

    from framework import ProcessContext
    from framework.backend import placement

    gpu = ProcessContext("cuda")  # where CPU Adam would be chosen
    which = shutil.which
    monkeypatch.setattr(
        shutil, "which", lambda name, *a, **k: None if name == "ninja" else which(name, *a, **k)
    )
    factory = functools.partial(torch.optim.AdamW, lr=1e-3)
    strategy = Strategy(sharding={"stage": 3, "offload_optimizer": True})
    assert placement.offload_optimizer(strategy, factory, gpu) is factory
    assert "CPU Adam cannot be built here (ninja is not installed)" in capsys.readouterr().out
    assert placement.offload_optimizer(Strategy(sharding={"stage": 3}), factory, gpu) is factory  # no offload
