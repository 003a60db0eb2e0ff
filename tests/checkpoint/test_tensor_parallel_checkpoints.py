"""Checkpoints under tensor parallelism, through the CLI: a TP2 run starts from whole weights
(`trainer.init_from`), killed with SIGKILL it resumes to the uninterrupted run's weights and logs
bit for bit; its checkpoint exports whole fp32 weights (`export --hf`, equal to what the live
engine gathers) that `from_pretrained` reloads to the run's own validation loss; it continues on
one process (TP1) through DeepSpeed's universal format; what cannot be converted says so in one line."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from framework import Callback, checkpoint
from framework.checkpoint import compatibility, safety, store
from framework.errors import CheckpointError
from framework.export import fp32_state_dict, load_weights, main, save_weights
from framework.models import LMLoss
from framework.plan.run_plan import Mesh
from framework.recipe import model as construct

from ..conftest import CONF, final_metrics, run_train
from .test_checkpoint import SLOW, kill_after, records, start

pytestmark = pytest.mark.timeout(600)

MAX_CHARS = 12000  # ~170 training windows of 64 characters, 18 validation windows
LLAMA = [
    "model=hf_llama", "model.config.vocab_size=128", "data=chars", f"data.dataset.max_chars={MAX_CHARS}",
    "loss=lm", "metrics=none", "trainer.batch_size=16", "trainer.max_steps=8", "trainer.log_freq=1",
    "trainer.checkpoint.save_freq=3",
]  # fmt: skip
TP2 = [*LLAMA, "+strategy=tp2", "trainer.devices=2"]  # ZeRO-1, tensor parallel over both ranks


class LiveWeights(Callback):
    """The running engine's consolidated weights (TP shards gathered live) when training starts
    and when it ends: `start.safetensors`, `end.safetensors` in `dir`."""

    def __init__(self, dir: str):
        self.dir = Path(dir)

    def on_fit_start(self, state, control):
        control.save_weights(str(self.dir / "start.safetensors"))

    def on_fit_end(self, state, control):
        control.save_weights(str(self.dir / "end.safetensors"))


def _validation_batch() -> tuple[torch.Tensor, torch.Tensor]:
    from framework.data.datasets import chars

    valid = chars(block_size=64, max_chars=MAX_CHARS, val_fraction=0.1).valid
    rows = [valid[i] for i in range(len(valid))]
    return torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """One uninterrupted TP2 run (checkpoints at steps 3, 6 and 8) that starts from whole weights
    (`trainer.init_from`: loaded into the shards); its dir and arguments."""
    x, _ = _validation_batch()
    root = tmp_path_factory.mktemp("tp2")
    config = construct.instantiate(OmegaConf.load(CONF / "model" / "hf_llama.yaml").config)
    config.vocab_size = 128
    torch.manual_seed(7)
    save_weights(transformers.LlamaForCausalLM(config).state_dict(), root / "init.safetensors")
    args = [*TP2, f"trainer.init_from={root / 'init.safetensors'}", f"trainer.valid_batch_size={len(x)}"]
    run_dir = root / "full"
    live = f"+callbacks.live={{_target_:{__name__}.LiveWeights,dir:{run_dir}}}"
    full = run_train([*args, live], run_dir)
    assert full.returncode == 0, full.stderr[-3000:]
    init, start = load_weights(root / "init.safetensors"), load_weights(run_dir / "start.safetensors")
    for key in init:
        assert torch.equal(start[key], init[key]), f"{key} was not loaded whole into the TP shards"
    return run_dir, args


def _shards(path: Path) -> list[dict[str, torch.Tensor]]:
    return [safety.load_safely(f)["module"] for f in sorted(path.glob("mp_rank_*_model_states.pt"))]


@pytest.mark.slow
def test_tp2_resumes_exactly_after_sigkill_and_exports_weights_that_reload(tp2_run, tmp_path):
    run_dir, args = tp2_run
    ckpts = run_dir / "checkpoints"
    assert json.loads((ckpts / "step_00000008" / "COMPLETE.json").read_text())["tp_size"] == 2
    killed = tmp_path / "killed"
    reached = kill_after(start([*args, SLOW], killed), killed, 4)
    assert reached < 8
    resumed = run_train([*args, "trainer.resume=auto"], killed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step" in resumed.stdout
    a, b = _shards(ckpts / "step_00000008"), _shards(killed / "checkpoints" / "step_00000008")
    assert len(a) == len(b) == 2 and a[0].keys() == b[0].keys()
    for shard_a, shard_b in zip(a, b):
        for key in shard_a:
            assert torch.equal(shard_a[key], shard_b[key]), (
                f"{key} differs after resuming (killed at {reached})"
            )
    assert records(killed) == records(run_dir)

    out = tmp_path / "hf"
    assert main([str(ckpts), str(out), "--hf"]) == 0  # TP shards merged through the universal format
    model = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    assert model.model.layers[0].mlp.down_proj.weight.shape == (128, 344)  # whole, not a rank's half
    live = load_weights(run_dir / "end.safetensors")  # what the running TP2 engine gathered
    assert live.keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, live[key]), f"{key}: the export differs from the live engine's weights"
    x, y = _validation_batch()
    with torch.no_grad():
        loss = float(LMLoss()(model(x).logits, y))
    assert loss == pytest.approx(final_metrics(run_dir)["val_loss"], abs=1e-5)


@pytest.mark.slow
def test_a_tp2_checkpoint_continues_on_one_process_through_the_universal_format(tp2_run, tmp_path):
    run_dir, _ = tp2_run
    ckpts = run_dir / "checkpoints"
    one = run_train([*LLAMA, "+strategy=zero1", f"trainer.resume={ckpts / 'step_00000003'}"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    a, c = fp32_state_dict(ckpts), fp32_state_dict(tmp_path / "checkpoints")
    assert a.keys() == c.keys()
    for key in a:
        torch.testing.assert_close(c[key], a[key], atol=2e-5, rtol=0, msg=f"{key} after a TP2 -> TP1 resume")


def _fake_checkpoint(path: Path, zero_stage: int, tp_size: int) -> Path:
    path.mkdir(parents=True)
    for rank in range(tp_size):
        torch.save({"module": {}}, path / f"mp_rank_{rank:02d}_model_states.pt")
    meta = {"step": 3, "world_size": tp_size, "dp_size": 1, "tp_size": tp_size, "micro_batch_size": 4}
    store.mark_complete(path, dict(meta, zero_stage=zero_stage, pipeline_stages=1))
    return path


def test_another_tensor_parallel_degree_needs_the_universal_format(tmp_path):
    zero1 = _fake_checkpoint(tmp_path / "a" / "step_00000003", zero_stage=1, tp_size=2)
    assert checkpoint.needs_universal(zero1, Mesh(2, 0, tp_size=1))  # dp 2, tp 1: another layout
    assert checkpoint.needs_universal(zero1, Mesh(1, 0))
    assert not checkpoint.needs_universal(zero1, Mesh(2, 0, tp_size=2))
    zero0 = _fake_checkpoint(tmp_path / "b" / "step_00000003", zero_stage=0, tp_size=2)
    assert not checkpoint.needs_universal(zero0, Mesh(1, 0))  # DeepSpeed converts ZeRO 1-3 only
    assert checkpoint.needs_universal(zero1, Mesh(4, 0, tp_size=2))  # TP2 x DP2
    one_rank = SimpleNamespace(dp_size=1, mesh=Mesh(1, 0), load_universal=True)  # what loading reads of a run
    with pytest.raises(
        CheckpointError, match="ZeRO-0 weights split over 2 tensor-parallel ranks, this run uses 1"
    ):
        compatibility.source(one_rank, zero0, store.read_meta(zero0))


def test_a_zero0_tensor_parallel_checkpoint_exports_whole_weights(tmp_path):
    # ZeRO-0 has no universal conversion: each rank's shards are put together by the affine map
    # AutoTP saves in the checkpoint (built here with DeepSpeed's own map functions)
    from deepspeed.checkpoint.affine import contiguous_split_map, replicated_map

    whole = {"col": torch.randn(4, 2), "row": torch.randn(2, 4), "norm": torch.randn(3)}
    maps = {
        "^col$": contiguous_split_map((4, 2), [2, 2], 0).to_dict(),
        "^row$": contiguous_split_map((2, 4), [2, 2], 1).to_dict(),
        "^norm$": replicated_map((3,), 2).to_dict(),
    }
    path = tmp_path / "step_00000003"
    path.mkdir()
    for tp in range(2):
        module = {
            "col": whole["col"][2 * tp : 2 * tp + 2].clone(),
            "row": whole["row"][:, 2 * tp : 2 * tp + 2].clone(),
            "norm": whole["norm"].clone(),
            "buf": torch.arange(3.0),
        }
        info = {"affine_map": {"version": 1, "params": maps}}
        torch.save(
            {"module": module, "universal_checkpoint_info": info}, path / f"mp_rank_{tp:02d}_model_states.pt"
        )
    meta = {"step": 3, "world_size": 2, "dp_size": 1, "tp_size": 2, "micro_batch_size": 4, "zero_stage": 0}
    store.mark_complete(path, meta)
    assert main([str(path), str(tmp_path / "w.safetensors")]) == 0
    out = load_weights(tmp_path / "w.safetensors")
    assert set(out) == {"col", "row", "norm", "buf"} and torch.equal(out["buf"], torch.arange(3.0))
    for key, value in whole.items():
        assert torch.equal(out[key], value), key


def test_export_reads_whole_weights_of_a_zero3_tensor_parallel_checkpoint(tmp_path):
    # ZeRO-3 names the model states zero_pp_rank_<dp>_mp_rank_<tp>_...; its parameters there are
    # empty, their whole fp32 values are in the universal conversion (made here as DeepSpeed does)
    path = tmp_path / "step_00000003"
    path.mkdir()
    whole = {"w": torch.randn(4, 2), "v": torch.randn(4)}
    for tp in range(2):
        module = {"w": torch.empty(0), "buf": torch.arange(3.0), "v": torch.empty(0)}
        states = {"module": module, "param_shapes": [{"w": (2, 2), "v": (4,)}], "shared_params": {}}
        torch.save(states, path / f"zero_pp_rank_0_mp_rank_{tp:02d}_model_states.pt")
    meta = {"step": 3, "world_size": 2, "dp_size": 1, "tp_size": 2, "micro_batch_size": 4, "zero_stage": 3}
    store.mark_complete(path, meta)
    universal = tmp_path / "step_00000003_universal"
    for name, value in whole.items():
        (universal / "zero" / name).mkdir(parents=True)
        torch.save({"param": value}, universal / "zero" / name / "fp32.pt")
    converted = dict(meta, converted_from=safety.sha256(path / store.COMPLETE))
    (universal / store.COMPLETE).write_text(json.dumps(converted))
    out = fp32_state_dict(path)
    assert list(out) == ["w", "buf", "v"]
    assert torch.equal(out["w"], whole["w"]) and torch.equal(out["v"], whole["v"])
    assert torch.equal(out["buf"], torch.arange(3.0))
