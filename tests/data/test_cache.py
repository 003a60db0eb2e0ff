"""Rendered rows kept (framework.data.datasets.cache), issue 48 item 18: a 50 MB chat file
rendered for ~150 s with no output, and again on the next run. Now a file's rows are kept under
a key of its bytes, the tokenizer, the options and the code: the next run reads them (token for
token the rows a fresh render gives, what was cut and dropped said again) without rendering,
and anything that changes the rows renders anew; a progress bar shows while rendering takes
long."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from framework.data.datasets import cache as cache_module  # noqa: E402
from framework.data.datasets.chat import hf_chat  # noqa: E402
from framework.data.datasets.preference import PairEncoder, hf_preference  # noqa: E402
from framework.data.datasets.render import ChatEncoder  # noqa: E402
from tests.helpers.tiny_chat import CONVERSATIONS, write_chat_jsonl  # noqa: E402
from tests.helpers.tiny_pairs import PAIRS, write_pairs_jsonl  # noqa: E402

LONG = [{"role": "user", "content": "say hello . " * 20}, {"role": "assistant", "content": "hello !"}]


def every_row(splits):
    return [{k: v.tolist() for k, v in row.items()} for part in splits for row in (part or [])]


def refuse_to_render(monkeypatch):
    """A render from now on fails the test: what follows reads kept rows."""

    def fail(*_):
        raise AssertionError("rendered again")

    monkeypatch.setattr(ChatEncoder, "encode_row", fail)
    monkeypatch.setattr(PairEncoder, "encode_row", fail)


def test_a_second_run_reads_the_kept_rows_exactly(tokenizers, tmp_path, monkeypatch, capsys):
    path = write_chat_jsonl(tmp_path / "chat.jsonl", [*CONVERSATIONS, LONG])
    options = dict(tokenizer=tokenizers.marked, val_fraction=0.25, max_length=40, cache=tmp_path / "kept")
    fresh = hf_chat(str(path), **options)
    said = capsys.readouterr().out
    assert "dropped" in said and "cut to max_length=40" in said
    assert len(list((tmp_path / "kept").glob("chat-*.npz"))) == 1
    with monkeypatch.context() as patch:
        refuse_to_render(patch)
        kept = hf_chat(str(path), **options)
        packed = hf_chat(str(path), **options, pack=True)  # packing and the split come after the cache
    assert every_row(kept) == every_row(fresh) and len(kept.train) == len(fresh.train) > 0
    assert [type(v) for v in kept.train[0].values()] == [type(v) for v in fresh.train[0].values()]
    assert capsys.readouterr().out.count("dropped") == 2 * said.count("dropped")  # said again
    assert set(packed.train[0]) == {"input_ids", "labels", "position_ids"}
    uncached = hf_chat(str(path), **{**options, "cache": False})
    assert every_row(uncached) == every_row(fresh)


def test_what_changes_the_rows_renders_them_anew(tokenizers, tmp_path, monkeypatch):
    path = write_chat_jsonl(tmp_path / "chat.jsonl")
    options = dict(val_fraction=0, cache=tmp_path / "kept")
    first = hf_chat(str(path), tokenizer=tokenizers.marked, **options)
    entries = lambda: len(list((tmp_path / "kept").iterdir()))  # noqa: E731
    for change in (
        dict(tokenizer=tokenizers.chatml),  # another tokenizer
        dict(tokenizer=tokenizers.marked, max_length=30),  # another option
        dict(tokenizer=tokenizers.marked, train_on_prompt=True),
    ):
        before = entries()
        assert every_row(hf_chat(str(path), **options, **change)) != every_row(first)
        assert entries() == before + 1
    write_chat_jsonl(path, CONVERSATIONS[::-1])  # the same name, other bytes
    assert every_row(hf_chat(str(path), tokenizer=tokenizers.marked, **options)) != every_row(first)
    with monkeypatch.context() as patch:
        refuse_to_render(patch)
        hf_chat(str(path), tokenizer=tokenizers.marked, **options)


def test_pairs_are_kept_too(tokenizers, tmp_path, monkeypatch):
    path = write_pairs_jsonl(tmp_path / "pairs.jsonl", [*PAIRS, {**PAIRS[0], "rejected": PAIRS[0]["chosen"]}])
    options = dict(tokenizer=tokenizers.marked, val_fraction=0, cache=tmp_path / "kept")
    fresh = hf_preference(str(path), **options)
    with monkeypatch.context() as patch:
        refuse_to_render(patch)
        kept = hf_preference(str(path), **options)
    assert every_row(kept) == every_row(fresh) and len(kept.train) == len(PAIRS)
    assert list(kept.train[0]) == list(fresh.train[0])


def test_the_default_place_is_under_the_datasets_cache(tokenizers, tmp_path):
    from datasets import config

    hf_chat(str(write_chat_jsonl(tmp_path / "mine.jsonl")), tokenizer=tokenizers.marked, val_fraction=0)
    assert list((config.HF_DATASETS_CACHE / "hydraspeed" / "rendered").glob("mine-*.npz"))


def test_a_render_that_takes_long_shows_a_progress_bar(tokenizers, tmp_path, monkeypatch, capsys):
    path = write_chat_jsonl(tmp_path / "chat.jsonl")
    hf_chat(str(path), tokenizer=tokenizers.marked, val_fraction=0, cache=False)
    assert "rendering" not in capsys.readouterr().err  # a quick one shows none
    monkeypatch.setattr(cache_module, "PROGRESS_AFTER_S", 0)
    hf_chat(str(path), tokenizer=tokenizers.marked, val_fraction=0, cache=False)
    err = capsys.readouterr().err
    assert "data: rendering chat.jsonl" in err and "100%" in err
