"""Expert parallelism (DeepSpeed AutoEP): the dependency and model checks made before DeepSpeed is
built, one step of a Mixtral with its experts split over 2 ranks equal to plain torch, and its
checkpoints (exact resume; export and whole-weight loads refused in one line).

AutoEP runs only with transformers 5.0 to 5.22.2 (`framework.backend.expert_parallel`). Where a newer one
is installed, the 2-rank test installs 5.22.2 once into ~/.cache/hydraspeed-ep-env (pip --target,
no dependencies: the installed huggingface_hub and tokenizers fit it) and puts it first on the
workers' PYTHONPATH; it skips, saying why, only where the package index cannot be reached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from framework import ConfigError
from framework.backend import expert_parallel as ep
from framework.backend.parallel import check_model
from framework.plan.run_plan import Mesh
from framework.plan.strategy import Strategy

from ..conftest import ROOT, run_cmd, run_layout_script, subprocess_env, torchrun

EP2_SECTION = {"expert_parallel": {"degree": 2}}
EP2 = Strategy(**EP2_SECTION)
TWO_RANKS = Mesh(world_size=2, rank=0, ep_size=2)


@pytest.mark.parametrize("version", ["5.0.0", "5.12.1", "5.22.2"])
def test_transformers_releases_autoep_runs_with_pass(version):
    ep.check_transformers(version)


@pytest.mark.parametrize("version", ["5.23.0", "5.24.0", "6.0.0", "4.57.1"])
def test_other_transformers_releases_are_refused_in_one_line(version):
    with pytest.raises(ConfigError) as error:
        ep.check_transformers(version)
    message = str(error.value)
    assert f"{version} is installed" in message and 'pip install "transformers>=5.0.0,<=5.22.2"' in message
    assert "\n" not in message


def mixtral(experts: int = 4) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=2,
    )  # fmt: skip
    return MixtralForCausalLM(config)


def test_model_check_reads_mixtral_experts_and_the_installed_transformers(monkeypatch):
    four, three = mixtral(4), mixtral(3)
    # By name: transformers' lazy module puts another object into sys.modules once a model is built.
    monkeypatch.setattr("transformers.__version__", "5.22.2")
    check_model(EP2, TWO_RANKS, four)  # 4 experts over 2 ranks
    with pytest.raises(ConfigError, match="does not divide the model's 3 experts"):
        check_model(EP2, TWO_RANKS, three)
    with pytest.raises(ConfigError, match="no mixture-of-experts layers"):
        check_model(EP2, TWO_RANKS, torch.nn.Linear(2, 2))
    monkeypatch.setattr("transformers.__version__", "5.23.0")
    with pytest.raises(ConfigError, match="5.23.0 is installed"):
        check_model(EP2, TWO_RANKS, four)
    check_model(Strategy(), Mesh(world_size=2, rank=0), four)  # no experts split: no demand
    with pytest.raises(ConfigError, match="tensor and expert parallelism together are not supported"):
        Strategy(tensor_parallel={"degree": 2}, **EP2_SECTION)


def test_gradient_clipping_beside_split_experts_needs_zero_1_to_3():
    with pytest.raises(ConfigError, match="needs ZeRO stage 1-3"):
        Strategy(sharding={"stage": 0}, gradient_clip={"max_norm": 1.0}, **EP2_SECTION)
    Strategy(sharding={"stage": 1}, gradient_clip={"max_norm": 1.0}, **EP2_SECTION)
    Strategy(sharding={"stage": 0}, **EP2_SECTION)  # no clipping: ZeRO-0 is exact


def test_optimizer_factory_gets_expert_groups_and_a_built_one_is_refused_where_zero_cannot_take_it():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert ep.optimizer_with_expert_groups(Strategy(), sgd) is sgd  # no expert parallelism: untouched
    for stage in (0, 3):  # DeepSpeed moves the replaced experts into its groups: exact at ZeRO 0 and 3
        assert ep.optimizer_with_expert_groups(Strategy(sharding={"stage": stage}, **EP2_SECTION), sgd) is sgd
    with pytest.raises(ConfigError, match="sharding.stage=1 needs the optimizer as a factory"):
        ep.optimizer_with_expert_groups(Strategy(sharding={"stage": 1}, **EP2_SECTION), sgd)
    dense, expert = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    expert.allreduce, expert.group_name = False, "ep_size_2"  # as AutoEP marks its experts
    factory = ep.optimizer_with_expert_groups(EP2, lambda groups: torch.optim.SGD(groups, lr=0.1))
    moe = [g for g in factory([dense, expert]).param_groups if g.get("moe")]
    assert [g["params"] for g in moe] == [[expert]] and moe[0]["name"] == "ep_size_2"


def test_a_checkpoint_of_split_experts_is_told_from_the_model_own_names():
    split = ["model.layers.0.mlp.router.gate.weight", "model.layers.0.mlp.experts.w1", "lm_head.weight"]
    assert ep.has_split_experts(split)
    assert not ep.has_split_experts(mixtral().state_dict())  # experts.gate_up_proj, experts.down_proj
    assert not ep.has_split_experts(["model.experts.w10", "w1"])


def adamw_step_after_a_load(steps: str) -> list[torch.Tensor]:
    """Two sub-groups' parameters after one AdamW step from loaded states whose `step` tensors are
    "own" (one each), "shared" (one for both, as DeepSpeed's ZeRO-3 universal load leaves them) or
    "unshared" (shared, then `unshare_optimizer_steps`)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    opt = torch.optim.AdamW([{"params": [p]} for p in params], lr=0.1)
    for p in params:
        p.grad = torch.ones(3)
    opt.step()
    loaded = torch.tensor(5.0)
    for p in params:
        opt.state[p]["step"] = loaded.clone() if steps == "own" else loaded
    if steps == "unshared":
        ep.unshare_optimizer_steps(opt)
    opt.step()
    return [p.detach().clone() for p in params]


def test_a_step_tensor_shared_by_sub_groups_is_made_one_each():
    own = adamw_step_after_a_load("own")
    assert not torch.equal(adamw_step_after_a_load("shared")[1], own[1])  # the second counts 7, not 6
    for got, want in zip(adamw_step_after_a_load("unshared"), own):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------- 2 ranks

ENV_CACHE = Path.home() / ".cache" / "hydraspeed-ep-env"


@pytest.fixture(scope="session")
def autoep_pythonpath() -> str:
    """A PYTHONPATH under which transformers is one AutoEP runs with: the installed one if it is,
    else transformers 5.22.2 installed once into ~/.cache/hydraspeed-ep-env (a skip only where no
    package index that has it can be reached)."""
    import transformers

    inherited = [p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p]
    try:
        ep.check_transformers(transformers.__version__)
        return os.pathsep.join(inherited)
    except ConfigError:
        pass
    target = ENV_CACHE / f"transformers-{ep.TRANSFORMERS_MAX}"
    if not (target / "transformers").is_dir():
        partial = target.with_name(target.name + f".partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        pip = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--timeout",
            "30",
            "--target",
            str(partial),
        ]
        run = subprocess.run(
            [*pip, f"transformers=={ep.TRANSFORMERS_MAX}"], capture_output=True, text=True, timeout=300
        )
        if run.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            # pip says no more than this when no index can be reached
            words = ("no matching distribution", "connection", "network", "name resolution")
            offline = any(word in run.stderr.lower() for word in words)
            message = (
                f"cannot install transformers {ep.TRANSFORMERS_MAX} for AutoEP: {run.stderr.strip()[-300:]}"
            )
            if offline:
                pytest.skip(message)
            pytest.fail(message)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)  # whole or absent: a killed install is never taken for a complete one
    return os.pathsep.join([str(target), *inherited])


@pytest.mark.slow
def test_expert_parallel_on_two_ranks_equals_one_process(tmp_path, autoep_pythonpath):
    """A tiny Mixtral and a DeepSeek-V3 (4 experts, top 2; a shared expert and a router bias) with
    their experts split over 2 ranks, ZeRO 0-3, accumulation 1 and 2: one SGD step's whole weights
    equal plain torch on the whole batch, and the logged loss is the global token mean; through
    `fit`, and through `run` with the weights exported by `Engine.save(training=False)` (every
    expert, under the model's own names) and reloaded by `from_pretrained`."""
    env = subprocess_env(PYTHONPATH=autoep_pythonpath)
    args = ["mixtral,deepseek", "ep2", "0,1,2,3", "1,2", "fit,export"]
    for result in run_layout_script(tmp_path, *args, timeout=240, env=env):
        assert len(result["errors"]) == 2 * 4 * 2 * 2


@pytest.mark.slow
def test_expert_parallel_checkpoints_on_two_ranks(tmp_path, autoep_pythonpath):
    """ZeRO-3, experts split over 2 ranks: a crash after the step-2 checkpoint and `resume=auto`
    end with the uninterrupted run's weights; exporting that checkpoint and loading whole weights
    into the split model each stop with one line naming what works."""
    script = str(ROOT / "tests" / "scripts" / "expert_parallel_checkpoint.py")
    run = run_cmd(
        [*torchrun(2), script, str(tmp_path)], timeout=180, env=subprocess_env(PYTHONPATH=autoep_pythonpath)
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["resumed_from"].endswith("step_00000002") and result["resume_error"] <= 1e-6
        assert "Engine.load(CKPT), then Engine.save(OUT, training=False)" in result["export"]
        assert "cannot be loaded into a model whose experts are split" in result["load"]
