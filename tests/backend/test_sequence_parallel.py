"""Sequence parallelism (DeepSpeed Ulysses): each rank's slice of a batch, the items it counts, the
gradient share, one-line errors, and on two ranks one SGD step equal to a 1-process reference
through fit and run at ZeRO 0-3 (and evaluation and prediction as without it), and the CLI."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from framework import ConfigError, Strategy
from framework.backend import sequence_parallel as sp
from framework.backend.parallel import check_model
from framework.data.outputs import ModelLoss
from framework.engine.items import counted_items, step_weights
from framework.engine.steps import update_metrics
from framework.models import GPT, LMLoss
from framework.observe.metrics import Accuracy, MetricSet
from framework.plan.run_plan import Mesh

from ..conftest import ROOT, final_metrics, run_layout_script, run_train

IDS = torch.arange(16).reshape(2, 8)
MASK = torch.tensor([[1] * 8, [1] * 3 + [0] * 5])  # the second sequence is padded on the right
LABELS = IDS.masked_fill(MASK == 0, -100)


def _mesh(rank: int) -> Mesh:
    return Mesh(world_size=2, rank=rank, sp_size=2)


def _batch() -> dict:
    return {"input_ids": IDS, "attention_mask": MASK, "labels": LABELS, "token_type_ids": IDS * 0, "tag": "x"}


def _llama(attn: str = "sdpa", heads: int = 4, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=8 * heads, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=16,
    )  # fmt: skip
    config._attn_implementation = attn
    return LlamaForCausalLM(config)


def test_each_rank_holds_its_chunk_of_the_sequences_labels_shifted_over_the_whole():
    parts = [sp.shard(_batch(), _mesh(rank)) for rank in (0, 1)]
    whole = lambda key: torch.cat([p[key] for p in parts], dim=1)  # noqa: E731
    assert [p["input_ids"].shape for p in parts] == [(2, 4), (2, 4)]
    assert torch.equal(whole("input_ids"), IDS) and torch.equal(whole("token_type_ids"), IDS * 0)
    assert torch.equal(whole("position_ids"), torch.arange(8).expand(2, 8))
    shifted = torch.cat([LABELS[:, 1:], torch.full((2, 1), -100)], dim=1)  # rank 0's last -> rank 1's first
    assert torch.equal(whole("shift_labels"), shifted) and torch.equal(whole("labels"), shifted)
    assert all("attention_mask" not in p and p["tag"] == "x" for p in parts)
    given = sp.shard({**_batch(), "position_ids": IDS + 5}, _mesh(1))  # given position ids are kept
    assert torch.equal(given["position_ids"], IDS[:, 4:] + 5)
    batch = _batch()
    assert sp.shard(batch, Mesh(world_size=2, rank=1)) is batch  # no sequence parallelism: as it is


def test_the_ranks_count_each_token_once_and_unshifted():
    llama = _llama()
    whole = counted_items(LABELS, ModelLoss(), llama)  # the causal LM's shift: 7 + 2 tokens
    parts = [sp.shard(_batch(), _mesh(rank))["shift_labels"] for rank in (0, 1)]
    assert sum(counted_items(p, ModelLoss(), llama, shifted=True) for p in parts) == whole == 9
    # without a process group each rank's weights use its own count: [n1, n2] x (dp x sp) x 2 / (n1 + n2)
    micros = [{k: v[i : i + 1] for k, v in _batch().items() if k != "tag"} for i in (0, 1)]
    weights = step_weights(micros, ModelLoss(), llama, "labels", _mesh(0))
    assert [w.item() for w in weights] == pytest.approx([4 * 4 / 6, 4 * 2 / 6])  # rank 0: 4 and 2 labels


def test_metrics_over_the_slices_equal_metrics_over_the_whole_sequences():
    """The slices' labels are shifted already: the metrics score them as they are."""
    engine = SimpleNamespace(output_key=None, loss=ModelLoss(), module=_llama())
    logits = torch.randn(2, 8, 32)
    logits[0, 2, LABELS[0, 3]] = 99.0  # a few right predictions, across the ranks' border too
    logits[0, 3, LABELS[0, 4]] = 99.0
    whole, sliced = MetricSet({"accuracy": Accuracy()}), MetricSet({"accuracy": Accuracy()})
    update_metrics(engine, whole, logits, LABELS)
    for rank in (0, 1):
        labels = sp.shard(_batch(), _mesh(rank))["labels"]
        update_metrics(engine, sliced, logits[:, 4 * rank : 4 * rank + 4], labels, aligned=True)
    assert sliced.compute() == whole.compute() and whole.compute()["accuracy"] >= 2 / 9


def test_a_slice_without_labels_gives_a_loss_of_zero_not_nan():
    llama = _llama()
    batch = sp.training_batch(_batch(), _mesh(1), ModelLoss())
    assert batch["num_items_in_batch"].item() == 3  # positions 4-7 of the first sequence (its last: -100)
    empty = {k: _batch()[k][1:] for k in ("input_ids", "attention_mask", "labels")}
    batch = sp.training_batch(empty, _mesh(1), ModelLoss())
    assert batch["num_items_in_batch"].item() == 1  # none: 0 / 1
    loss = llama(**batch).loss  # the core attention on the slice alone: enough for the loss's reduction
    assert loss.item() == 0.0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_gradient_share_keeps_the_value_and_corrects_zero_0_to_2(stage):
    w = torch.tensor(3.0, requires_grad=True)
    loss = sp.gradient_share(w * 2, _mesh(0), stage)
    loss.backward()
    assert loss.item() == 6.0 and w.grad.item() == (2.0 if stage == 3 else 1.0)


def _one_line(error: pytest.ExceptionInfo, *words: str) -> None:
    text = str(error.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_what_sequence_parallelism_cannot_take_is_a_one_line_error():
    with pytest.raises(ConfigError) as err:
        sp.shard({"input_ids": IDS[:, :7]}, _mesh(0))
    _one_line(err, "7 tokens", "multiple of 2")
    with pytest.raises(ConfigError) as err:
        sp.shard((IDS, LABELS), _mesh(0))
    _one_line(err, "dict batches with input_ids")
    with pytest.raises(ConfigError) as err:
        sp.training_batch(_batch(), _mesh(0), LMLoss())
    _one_line(err, "loss=model")
    with pytest.raises(ConfigError) as err:
        sp.training_batch({**_batch(), "attention_mask": MASK.flip(1)}, _mesh(0), ModelLoss())
    _one_line(err, "padded on the left", "padding_side='right'")
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]).expand(IDS.shape[0], -1)
    with pytest.raises(ConfigError) as err:
        sp.training_batch({**_batch(), "position_ids": packed}, _mesh(0), ModelLoss())
    _one_line(err, "packed rows", "data.dataset.pack=false")
    strategy = Strategy(sequence_parallel={"degree": 2})
    with pytest.raises(ConfigError) as err:
        check_model(strategy, _mesh(0), GPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
    _one_line(err, "Hugging Face causal LM", "GPT")
    with pytest.raises(ConfigError) as err:
        check_model(strategy, _mesh(0), _llama(attn="eager"))
    _one_line(err, "'eager'", "attn_implementation='sdpa'")
    with pytest.raises(ConfigError) as err:
        check_model(strategy, _mesh(0), _llama(heads=3, kv_heads=3))
    _one_line(err, "does not divide the model's 3 attention heads")
    check_model(strategy, _mesh(0), _llama())  # sdpa, 4 heads, 2 key-value heads: fine


@pytest.mark.slow
def test_one_sgd_step_on_two_sequence_parallel_ranks_equals_one_process(tmp_path):
    """A Llama with loss=model, each of 2 ranks holding half of every padded sequence (2 to 16
    counted tokens): ZeRO 0-3 x accumulation 1/2, fit and run, weights (the gradient clipped at
    half its norm), the logged loss and the fetched grad_norm equal the 1-process reference's;
    prediction (every position, padding too) and evaluation equal the model's without SP."""
    args = ["llama", "sp2", "0,1,2,3", "1,2", "fit,run,predict,evaluate"]
    for out in run_layout_script(tmp_path, *args, timeout=240):
        assert len(out["errors"]) == 4 * 2 * 2 + 2
        assert {"llama sp2 predict", "llama sp2 evaluate"} <= set(out["errors"])
        assert set(map(tuple, out["lengths"].values())) == {(8,)}  # each rank trained on 8 of 16 tokens


@pytest.mark.slow
def test_the_cli_trains_a_llama_with_sequence_parallelism(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text((ROOT / "README.md").read_text()[:8000])
    args = ["model=hf_llama", "data=hf_text", f"data.dataset.data_files={notes}", "data.dataset.block_size=64",
            "loss=model", "metrics=none", "+strategy=sp2", "trainer.devices=2", "trainer.max_steps=3",
            "trainer.batch_size=4"]  # fmt: skip
    run = run_train(args, tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "SP 2" in run.stdout
    metrics = final_metrics(tmp_path / "run")
    assert metrics["step"] == 3 and 0 < metrics["val_loss"] < 10
