"""Chat data (`data=hf_chat`, framework.data.datasets.chat): labels on the assistant's tokens as
the template's generation markers say, the same labels from a template without them, dropped and
cut conversations counted, malformed rows named, packing and streaming giving the rows and the
loss of plain rows. In-process, on the tiny chat tokenizer of tests/helpers/tiny_chat.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from framework import ConfigError  # noqa: E402
from framework.data.datasets.chat import hf_chat  # noqa: E402
from framework.data.labels import IGNORE_INDEX  # noqa: E402
from framework.data.stream_loader import StreamLoader  # noqa: E402
from framework.data.streams import Reader  # noqa: E402
from framework.engine.steps import forward_loss  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.helpers.tiny_chat import (  # noqa: E402
    CONVERSATIONS,
    chat_template,
    tiny_chat_tokenizer,
    tiny_llama,
    write_chat_jsonl,
)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """Tokenizer dirs with and without generation markers, and a JSONL of the conversations."""
    root = tmp_path_factory.mktemp("chat")
    for marked in (True, False):
        tiny_chat_tokenizer(marked).save_pretrained(root / ("marked" if marked else "plain"))
    return SimpleNamespace(
        marked=str(root / "marked"),
        plain=str(root / "plain"),
        file=str(write_chat_jsonl(root / "chat.jsonl")),
    )


def rows(splits):
    return [(r["input_ids"].tolist(), r["labels"].tolist()) for r in splits.train]


def test_labels_are_the_tokens_the_templates_generation_markers_mark(chat):
    tok = tiny_chat_tokenizer(True)
    got = rows(hf_chat(chat.file, tokenizer=chat.marked, val_fraction=0))
    expected = []
    for messages in CONVERSATIONS:
        out = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = out["input_ids"], out["assistant_masks"]
        expected.append((ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]))
    assert got == expected
    assert all(sum(label != IGNORE_INDEX for label in labels) > 0 for _, labels in got)


def test_a_template_without_generation_markers_gives_the_same_labels(chat, capsys):
    marked = rows(hf_chat(chat.file, tokenizer=chat.marked, val_fraction=0))
    assert rows(hf_chat(chat.file, tokenizer=chat.plain, val_fraction=0)) == marked
    # the same template given in the config in place of the tokenizer's
    assert (
        rows(hf_chat(chat.file, tokenizer=chat.marked, chat_template=chat_template(False), val_fraction=0))
        == marked
    )
    # nothing cut, nothing dropped: only the format is said
    assert (
        capsys.readouterr().out.splitlines()
        == [f"data: chat messages (messages: role/content) in {chat.file}"] * 3
    )


def test_train_on_prompt_labels_every_token(chat):
    for ids, labels in rows(hf_chat(chat.file, tokenizer=chat.plain, val_fraction=0, train_on_prompt=True)):
        assert labels == ids


def test_conversations_left_with_nothing_to_learn_are_counted_and_dropped(chat, tmp_path, capsys):
    """TRL 980/1191: masks that come out all -100 kept such examples silently. Here a conversation
    cut before its first assistant token, and one without an assistant turn, are dropped and
    counted; those cut after it are kept and counted as cut."""
    long_prompt = [
        {"role": "user", "content": "say hello . " * 20},
        {"role": "assistant", "content": "hello !"},
    ]
    no_answer = [{"role": "user", "content": "say hello ."}]
    path = write_chat_jsonl(tmp_path / "c.jsonl", [*CONVERSATIONS, long_prompt, no_answer])
    splits = hf_chat(str(path), tokenizer=chat.marked, val_fraction=0, max_length=48)
    out = capsys.readouterr().out.splitlines()
    cut = sum(len(r["input_ids"]) for r in splits.train if len(r["input_ids"]) == 48)
    assert len(splits.train) == len(CONVERSATIONS)  # the two without a label that counts are gone
    full = rows(hf_chat(chat.file, tokenizer=chat.marked, val_fraction=0))
    longer = sum(len(ids) > 48 for ids, _ in full)
    assert cut == 48 * longer and longer > 0
    assert out == [
        f"data: chat messages (messages: role/content) in {path}",
        f"data: {longer + 1} of 10 conversations cut to max_length=48 tokens (data.dataset.max_length to change)",
        "data: 2 of 10 conversations dropped: no assistant token within max_length=48 (cut before the first, "
        "or no assistant turn); data.dataset.max_length to change",
    ]
    for row in splits.train:  # every kept row counts a label after the causal shift
        assert (row["labels"][1:] != IGNORE_INDEX).any()
    # streamed, never counted to its end: the first drop and every doubling of the count are said
    streamed = hf_chat(
        str(path), tokenizer=chat.marked, val_fraction=0, max_length=48, streaming=True, shards=1
    )
    assert len(list(Reader(streamed.train, 0, 1, 0, {}))) == len(CONVERSATIONS)
    said = [line.split(":")[1] for line in capsys.readouterr().out.splitlines() if "dropped" in line]
    assert said == [" 1 of 9 conversations read so far dropped", " 2 of 10 conversations read so far dropped"]


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"chat": []},
            r"line 2: no 'messages' in the row \(it has \['chat'\]\); data.dataset.messages_column",
        ),
        ({"messages": "hello"}, r"line 2: 'messages' must be a list of \{role, content\} messages, not str"),
        ({"messages": [{"role": 3, "content": "x"}]}, r"line 2: message 0 has role 3; a role is a string"),
    ],
)
def test_a_malformed_row_is_one_line_naming_its_file_and_line(chat, tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=f"^{path} {message}") as caught:
        hf_chat(str(path), tokenizer=chat.marked, val_fraction=0)
    assert "\n" not in str(caught.value)


def test_text_data_of_message_lists_points_at_hf_chat(chat):
    """Before, data=hf_text with text_column=messages trained on the Python str() of each list."""
    from framework.data.datasets.hf import hf_stream, hf_text

    expected = r"text_column=messages holds lists of messages, not text: for conversations use data=hf_chat"
    with pytest.raises(ConfigError, match=expected):
        hf_text(chat.file, builder="json", text_column="messages")
    stream = hf_stream(chat.file, builder="json", text_column="messages", shards=1)
    with pytest.raises(ConfigError, match=expected):
        next(iter(Reader(stream.train, 0, 1, 0, {})))


def test_a_tokenizer_without_a_chat_template_or_none_at_all_is_one_line(chat, tmp_path):
    with pytest.raises(
        ConfigError, match="data=hf_chat needs a tokenizer with a chat template: model.path=DIR"
    ):
        hf_chat(chat.file)
    tok = tiny_chat_tokenizer(True)
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "bare")
    with pytest.raises(ConfigError, match="has no chat template: give one with data.dataset.chat_template="):
        hf_chat(chat.file, tokenizer=str(tmp_path / "bare"))


def test_a_validation_fraction_holds_out_whole_conversations(chat):
    splits = hf_chat(chat.file, tokenizer=chat.marked, val_fraction=0.25)
    assert (len(splits.train), len(splits.valid)) == (6, 2)
    whole = rows(hf_chat(chat.file, tokenizer=chat.marked, val_fraction=0))
    parts = rows(splits) + [(r["input_ids"].tolist(), r["labels"].tolist()) for r in splits.valid]
    assert sorted(parts) == sorted(whole)


def test_packed_chat_gives_the_per_token_loss_of_one_conversation_per_row(chat):
    """Whole conversations packed (position ids restart, no attention across them): a Llama's
    counted-token loss over the blocks equals its loss over the padded rows (fp32, 1e-5)."""
    packed = hf_chat(chat.file, tokenizer=chat.marked, val_fraction=0, max_length=96, pack=True)
    plain = hf_chat(chat.file, tokenizer=chat.marked, val_fraction=0, max_length=96)
    assert 1 < len(packed.train) < len(plain.train)
    assert sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in packed.train) == sum(
        int((r["labels"][1:] != IGNORE_INDEX).sum()) for r in plain.train
    )
    model = tiny_llama(tiny_chat_tokenizer(True)).train()
    step = SimpleNamespace(model=model, module=model, label_key="labels", loss="model")
    lengths = [len(b["input_ids"]) for b in packed.train]
    assert max(lengths) <= 96
    with torch.no_grad():
        blocks = packed.collate_fn([packed.train[i] for i in range(len(packed.train))])
        assert "attention_mask" not in blocks and blocks["input_ids"].shape[1] == max(lengths)
        padded = plain.collate_fn([plain.train[i] for i in range(len(plain.train))])
        assert padded["labels"][padded["attention_mask"] == 0].eq(IGNORE_INDEX).all()
        assert abs(float(forward_loss(step, blocks)[2]) - float(forward_loss(step, padded)[2])) < 1e-5


def test_a_chat_stream_gives_the_map_style_rows(chat, pack=False):
    mapped = hf_chat(chat.file, tokenizer=chat.plain, val_fraction=0, max_length=64, pack=pack)
    streamed = hf_chat(
        chat.file, tokenizer=chat.plain, val_fraction=0, max_length=64, pack=pack, streaming=True, shards=1
    )
    got = [item for item, _, _ in Reader(streamed.train, 0, 1, 0, {})]
    assert streamed.valid is None and len(got) == len(mapped.train)
    for item, row in zip(got, mapped.train):
        assert {k: v.tolist() for k, v in item.items()} == {k: v.tolist() for k, v in row.items()}


def test_a_chat_stream_resumes_exactly(chat, tmp_path):
    path = write_chat_jsonl(tmp_path / "many.jsonl", CONVERSATIONS * 4)
    stream = hf_chat(
        str(path),
        tokenizer=chat.marked,
        val_fraction=0.25,
        max_length=64,
        pack=True,
        streaming=True,
        shards=4,
    )
    stream.train.shuffle_window = 8

    def blocks(loader, limit=None):
        out = []
        for batch in loader:
            out.append(batch["input_ids"].tolist())
            if len(out) == limit:
                break
        return out

    whole = blocks(StreamLoader(stream.train, 2, 1, 0))
    pieces, state = [], None
    for limit in (2, 3, None):
        loader = StreamLoader(stream.train, 2, 1, 0)
        if state is not None:
            loader.load_state_dict(state)
        pieces += blocks(loader, limit)
        state = loader.state_dict()
    assert pieces == whole and len(whole) > 5
    held_out = [item for r in range(4) for item, _, _ in Reader(stream.valid, r, 4, 0, {})]
    assert held_out and all(len(b["input_ids"]) == 64 for b in held_out)


def test_a_template_whose_prefixes_are_not_beginnings_of_the_whole_asks_for_markers(chat, tmp_path):
    """Qwen3 1522: templates that render earlier assistant turns otherwise once the conversation
    goes on (dropping their reasoning) have no assistant spans to find by prefixes: one line."""
    template = chat_template(False).replace(
        "{{ message['content'] }}<|eot_id|>{% else %}",
        "{{ message['content'] if loop.last else '' }}<|eot_id|>{% else %}",
    )
    assert template != chat_template(False)
    path = write_chat_jsonl(tmp_path / "two.jsonl", [CONVERSATIONS[1]])
    with pytest.raises(
        ConfigError, match=r"two.jsonl line 1: the chat template renders .* \{% generation %\} markers"
    ):
        hf_chat(str(path), tokenizer=chat.plain, chat_template=template, val_fraction=0)


def test_the_shipped_tiny_chat_example_is_what_the_helper_makes(tmp_path):
    """examples/tiny_chat (what experiment=lora_chat trains on) cannot drift from the tests' helper."""
    from framework.integrations.hf import tokenizer_from
    from tests.helpers.tiny_chat import CONVERSATIONS, tiny_chat_tokenizer

    shipped = tokenizer_from(ROOT / "examples" / "tiny_chat")
    made = tiny_chat_tokenizer(generation_markers=True)
    assert shipped.get_vocab() == made.get_vocab() and shipped.chat_template == made.chat_template
    rows = [json.loads(line)["messages"] for line in (ROOT / "examples" / "tiny_chat" / "chat.jsonl").open()]
    assert rows == CONVERSATIONS
