"""Packed rows keep their documents apart: every document's per-token loss and gradient in a
padding-free packed row equal the document run alone (1e-5), for a tiny Llama under eager and
sdpa attention, however it is called (by hand with its cache on, with a 2-D attention mask, in
training), and for the framework's GPT; the same comparison fails when the documents may see
each other, so it would catch contamination."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framework.data.bins import PackedCollator, pack_rows
from framework.data.labels import IGNORE_INDEX
from framework.errors import ConfigError
from framework.integrations.packed import causal_document_mask, documents, keep_documents_apart
from framework.models.gpt import GPT

pytest.importorskip("transformers")

from tests.helpers.tiny_chat import tiny_chat_tokenizer, tiny_llama  # noqa: E402

LENGTHS = (9, 5, 12, 7)


def _documents(vocab: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(5, vocab, (n,), generator=g).tolist()
        labels = [IGNORE_INDEX if i < 2 else t for i, t in enumerate(ids)]  # a prompt not learned
        out.append((ids, labels))
    return out


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss of next-token logits (rows, T, V) against labels (rows, T), shifted."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        labels[:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def _alone(model, docs, call):
    """Each document's per-token losses and gradient, run alone."""
    out = []
    for ids, labels in docs:
        losses = _token_losses(call(model, {"input_ids": torch.tensor([ids])}), torch.tensor([labels]))
        losses.sum().backward()
        out.append((losses.detach(), _grads(model)))
    return out


def _packed(model, docs, call, row):
    """Each document's per-token losses and gradient, taken from one packed forward per document."""
    out, start = [], 0
    for ids, _ in docs:
        logits = call(model, row)
        losses = _token_losses(logits, row["labels"])
        mine = losses[start : start + len(ids) - 1]  # its tokens' losses; the next document's first is -100
        mine.sum().backward()
        out.append((mine.detach(), _grads(model)))
        start += len(ids)
    return out


def _row(docs) -> dict[str, torch.Tensor]:
    (row,) = pack_rows(docs, capacity=sum(LENGTHS))
    return PackedCollator(0)([row])


def _close(alone, packed, tol: float = 1e-5) -> bool:
    return all(
        torch.allclose(a[0], p[0], atol=tol, rtol=0)
        and all(torch.allclose(x, y, atol=tol, rtol=0) for x, y in zip(a[1], p[1]))
        for a, p in zip(alone, packed)
    )


def _hf(model, batch, **extra):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs, **extra).logits


CALLS = {
    "by hand (cache on)": lambda m, b: _hf(m, b),
    "2-D attention mask": lambda m, b: _hf(m, b, attention_mask=torch.ones_like(b["input_ids"])),
    "training (no cache)": lambda m, b: _hf(m, b, use_cache=False),
}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_chat_tokenizer()


@pytest.mark.parametrize("core", ["eager", "sdpa"])
@pytest.mark.parametrize("how", list(CALLS))
def test_a_packed_document_has_its_loss_and_gradient_alone(tokenizer, core, how):
    model = tiny_llama(tokenizer)
    model.config._attn_implementation = core
    keep_documents_apart(model)
    docs = _documents(len(tokenizer))
    row = _row(docs)
    assert "attention_mask" not in row and row["position_ids"].tolist()[0][:10] == [*range(9), 0]
    assert _close(_alone(model, docs, CALLS[how]), _packed(model, docs, CALLS[how], row))


@pytest.mark.parametrize("core", ["eager", "sdpa"])
def test_the_comparison_fails_when_documents_see_each_other(tokenizer, core):
    """The boundary dropped (position ids running on), or transformers left alone with a 2-D
    mask (PR 46634's trap): the documents after the first differ from themselves alone."""
    docs = _documents(len(tokenizer))
    row = _row(docs)
    call = CALLS["2-D attention mask"]
    hooked = keep_documents_apart(tiny_llama(tokenizer))
    hooked.config._attn_implementation = core
    alone = _alone(hooked, docs, call)
    joined = {**row, "position_ids": torch.arange(row["input_ids"].shape[1])[None]}
    assert not _close(alone, _packed(hooked, docs, call, joined))
    plain = tiny_llama(tokenizer)  # no hook: the 2-D mask hides the documents from transformers
    plain.config._attn_implementation = core
    assert not _close(alone, _packed(plain, docs, call, row))


def test_an_attention_that_cannot_keep_them_apart_is_refused(tokenizer):
    model = keep_documents_apart(tiny_llama(tokenizer))
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="packed rows"):
        _hf(model, _row(_documents(len(tokenizer))))


def test_the_framework_gpt_keeps_packed_documents_apart():
    model = GPT(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32)
    docs = _documents(64)
    row = _row(docs)

    def call(m, b):
        return m(b["input_ids"], b.get("position_ids"))

    alone = _alone(model, docs, call)
    assert _close(alone, _packed(model, docs, call, row))
    joined = {**row, "position_ids": torch.arange(row["input_ids"].shape[1])[None]}
    assert not _close(alone, _packed(model, docs, call, joined))


def test_a_mask_is_causal_within_documents_and_off_padding():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert documents(positions).tolist() == [[0, 0, 0, 1, 1, 2]]
    assert documents(torch.arange(5)[None]) is None
    mask = causal_document_mask(positions, torch.tensor([[1, 1, 1, 1, 1, 0]]))[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False]
    assert mask[5].tolist() == [False] * 5 + [True]  # padding sees itself only


def test_rows_laid_out_for_generation_are_not_packed_rows():
    """A left-padded prompt with its right-padded completion (position ids that follow the mask,
    GRPO's layout) restarts only next to padding: one document, left to the model's own mask,
    and no refusal under sequence parallelism; a restart between two real tokens is packed."""
    from framework.methods.rollout import laid_out

    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = laid_out(
        torch.ones(2, 4, dtype=torch.long), prompt_mask, torch.ones(2, 3, dtype=torch.long), completion_mask
    )
    assert documents(batch.position_ids) is not None  # restarts, seen without the mask
    assert documents(batch.position_ids, batch.attention_mask) is None
    packed = torch.tensor([[0, 1, 0, 1, 2, 2]])
    assert documents(packed, torch.tensor([[1, 1, 1, 1, 1, 0]])) is not None
