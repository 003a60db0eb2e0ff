"""A Hugging Face user's first hour: padded batches under recompute, the `hf` extra, tokenizers
that belong to the model, text classification from files, and the numbers the run reports."""

from __future__ import annotations

import functools

import pytest
import torch

from framework import Engine, Strategy, device

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _fresh_group():
    yield
    device.destroy_process_group()


def tiny_llama(vocab_size: int = 64) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def padded_rows(n: int = 16, length: int = 16) -> list[dict[str, torch.Tensor]]:
    """Rows of a padded batch: every other row ends in padding (attention_mask 0, label -100)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (n, length), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, length * 2 // 3 :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels)]


# ------------------------------------------------------------------------------------- recompute


@pytest.mark.parametrize("stage", [0, 3])
def test_recompute_on_a_padded_batch_trains_as_without_it(stage, capsys):
    """The model's key/value cache would grow again in the recomputation (keys twice the mask's
    length in backward): under recompute it is off, said in one line, and the losses are those of
    the same run without recompute."""
    losses = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        strategy = Strategy(sharding={"stage": stage}, recompute={"enable": recompute})
        engine = Engine(tiny_llama(), "model", functools.partial(torch.optim.SGD, lr=0.5), strategy=strategy)
        history = engine.fit(padded_rows(), epochs=2, batch_size=8, shuffle=False, log_freq=1)
        losses[recompute] = history["loss"]
        device.destroy_process_group()
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert losses[True][-1] < losses[True][0]
    out = capsys.readouterr().out
    assert out.count("recompute: use_cache turned off for LlamaForCausalLM") == 1
