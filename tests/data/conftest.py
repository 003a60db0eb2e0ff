"""What the chat and pairs data tests share: tokenizer directories made locally (no download),
a cache directory of their own for rendered rows, and the step-1 loss of a tiny Llama."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture(scope="session")
def tokenizers(tmp_path_factory):
    """Directories of the tiny Llama-3-like chat tokenizer with and without generation markers,
    and of the tiny ChatML one with markers."""
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    from tests.helpers.tiny_chat import tiny_chat_tokenizer, tiny_chatml_tokenizer

    root = tmp_path_factory.mktemp("tokenizers")
    tiny_chat_tokenizer(True).save_pretrained(root / "marked")
    tiny_chat_tokenizer(False).save_pretrained(root / "plain")
    tiny_chatml_tokenizer(True).save_pretrained(root / "chatml")
    return SimpleNamespace(
        marked=str(root / "marked"), plain=str(root / "plain"), chatml=str(root / "chatml")
    )


def rows(splits):
    """(input_ids, labels) of each training row, as lists."""
    return [(r["input_ids"].tolist(), r["labels"].tolist()) for r in splits.train]


def step1_loss(splits, seed: int = 0) -> float:
    """A tiny Llama's loss (over the counted tokens) of one batch of every training row: what a
    run's first step logs with one global batch of the whole file."""
    import torch

    from framework.engine.steps import forward_loss
    from tests.helpers.tiny_chat import tiny_llama

    model = tiny_llama(splits.tokenizer, seed=seed).train()
    step = SimpleNamespace(model=model, module=model, label_key="labels", loss="model")
    batch = splits.collate_fn([splits.train[i] for i in range(len(splits.train))])
    with torch.no_grad():
        return float(forward_loss(step, batch)[2])


@pytest.fixture(autouse=True, scope="session")
def _rendered_rows_kept_aside(tmp_path_factory):
    """`data.dataset.cache=true` keeps rendered rows under `datasets`' cache: here, a directory of
    the session's, not the user's."""
    try:
        from datasets import config
    except ImportError:
        yield
        return
    saved = config.HF_DATASETS_CACHE
    config.HF_DATASETS_CACHE = tmp_path_factory.mktemp("hf_datasets_cache")
    yield
    config.HF_DATASETS_CACHE = saved
