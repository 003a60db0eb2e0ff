"""Chat data as people have it (framework.data.datasets.formats): ShareGPT, Alpaca and
prompt-completion rows told from their shape and said in one line, read as the messages file of
the same conversations (the same tokens and labels, so the same step-1 loss); other names mapped
from the config; content given as OpenAI text parts; messages without content refused in one
line. In-process, on the tiny chat tokenizers of tests/helpers/tiny_chat.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from framework import ConfigError  # noqa: E402
from framework.data.datasets.chat import hf_chat  # noqa: E402
from framework.data.datasets.formats import ChatFormat, Reading  # noqa: E402
from framework.data.streams import Reader  # noqa: E402
from tests.data.conftest import rows, step1_loss  # noqa: E402
from tests.helpers.tiny_chat import CONVERSATIONS, tiny_llama, write_chat_jsonl  # noqa: E402

SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def sharegpt(conversation):
    return {
        "conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in conversation]
    }


def test_sharegpt_conversations_read_as_the_messages_file(tokenizers, tmp_path, capsys):
    """Issue 49: ShareGPT failed with "message 0 has role None". Now, with no option given, the
    same 8 conversations give the messages file's tokens and labels, so its step-1 loss."""
    messages = hf_chat(
        str(write_chat_jsonl(tmp_path / "m.jsonl")), tokenizer=tokenizers.marked, val_fraction=0
    )
    path = write_jsonl(tmp_path / "chat.jsonl", [sharegpt(c) for c in CONVERSATIONS])
    shared = hf_chat(path, tokenizer=tokenizers.marked, val_fraction=0)
    assert f"data: ShareGPT conversations (conversations: from/value) in {path}" in capsys.readouterr().out
    assert rows(shared) == rows(messages) and len(rows(shared)) == 8
    assert step1_loss(shared) == pytest.approx(step1_loss(messages), abs=1e-6)


def alpaca(conversation):
    """The conversation as an Alpaca row: its system turn a column, its earlier turns the
    history, its last user turn the instruction and the last answer the output."""
    system = [m["content"] for m in conversation if m["role"] == "system"]
    turns = [m["content"] for m in conversation if m["role"] != "system"]
    history = [[turns[i], turns[i + 1]] for i in range(0, len(turns) - 2, 2)]
    return {
        "instruction": turns[-2],
        "input": "",
        "output": turns[-1],
        "history": history,
        "system": (system or [""])[0],
    }


def test_alpaca_rows_read_as_the_messages_file_of_their_user_turn(tokenizers, tmp_path, capsys):
    """Issue 49: Alpaca rows failed with a hint about messages_column. The user turn is the
    instruction, then a blank line and the input when there is one; system and history columns
    give the turns before."""
    records = [alpaca(c) for c in CONVERSATIONS]
    records[2] = {"instruction": "count to", "input": "three .", "output": "one two three ."}
    path = write_jsonl(tmp_path / "alpaca.jsonl", records)
    read = hf_chat(path, tokenizer=tokenizers.plain, val_fraction=0)
    assert f"data: Alpaca rows (instruction/input/output) in {path}" in capsys.readouterr().out
    conversations = [list(c) for c in CONVERSATIONS]
    conversations[2] = [{"role": "user", "content": "count to\n\nthree ."}, conversations[2][1]]
    messages = hf_chat(
        str(write_chat_jsonl(tmp_path / "m.jsonl", conversations)), tokenizer=tokenizers.plain, val_fraction=0
    )
    assert rows(read) == rows(messages)
    assert step1_loss(read) == pytest.approx(step1_loss(messages), abs=1e-6)
    sample = ChatFormat("alpaca", Reading()).sample(records[2], "x line 3")
    assert sample.messages[0] == {"role": "user", "content": "count to\n\nthree ."}


def test_conversational_prompt_completion_reads_as_the_messages_file(tokenizers, tmp_path, capsys):
    """TRL's prompt-completion rows (refused before): the loss on the completion, the prompt's
    tokens -100: the messages file of the same conversations (each up to its first answer)."""
    records, conversations = [], []
    for c in CONVERSATIONS:
        first = next(i for i, m in enumerate(c) if m["role"] == "assistant")
        records.append({"prompt": c[:first], "completion": [c[first]]})
        conversations.append(c[: first + 1])
    path = write_jsonl(tmp_path / "pc.jsonl", records)
    read = hf_chat(path, tokenizer=tokenizers.marked, val_fraction=0)
    assert (
        f"data: prompt-completion rows (chat messages: loss on the completion) in {path}"
        in capsys.readouterr().out
    )
    messages = hf_chat(
        str(write_chat_jsonl(tmp_path / "m.jsonl", conversations)),
        tokenizer=tokenizers.marked,
        val_fraction=0,
    )
    assert rows(read) == rows(messages)
    assert step1_loss(read) == pytest.approx(step1_loss(messages), abs=1e-6)


def test_prompt_completion_rows_tokenize_as_trls_sft_trainer(tokenizers, tmp_path):
    """Plain strings are raw text (no template, EOS appended) with the loss on the completion's
    tokens only; message lists go through the template, the completion what it renders after the
    prompt (ChatML's newline after <|im_end|> included): TRL's SFTTrainer's tokens and labels."""
    trl = pytest.importorskip("trl", reason="needs the bench extra: pip install -e '.[bench]'")
    datasets = pytest.importorskip("datasets", reason="needs the hf extra: pip install -e '.[hf]'")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizers.chatml)
    texts = [
        {"prompt": "count to three .", "completion": " one two three ."},
        {"prompt": "say hello", "completion": " ."},
    ]
    chats = [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS]
    for name, records in (("text", texts), ("chat", chats)):
        path = write_jsonl(tmp_path / f"{name}.jsonl", records)
        ours = rows(hf_chat(path, tokenizer=tokenizers.chatml, val_fraction=0))
        args = trl.SFTConfig(output_dir=str(tmp_path / name), report_to=[], use_cpu=True, max_length=None)
        model = tiny_llama(tok)
        trainer = trl.SFTTrainer(
            model=model, args=args, train_dataset=datasets.Dataset.from_list(records), processing_class=tok
        )
        theirs = [(r["input_ids"], r["labels"]) for r in trainer.train_dataset]
        assert ours == theirs, name


def test_columns_keys_and_roles_of_another_naming(tokenizers, tmp_path):
    """Axolotl's field_messages / message_property_mappings / roles and LLaMA-Factory's columns /
    tags: other names read as the messages file; `format` sets the shape."""
    records = [
        {"dialog": [{"speaker": {"user": "customer", "assistant": "agent", "system": "rules"}[m["role"]], "text": m["content"]} for m in c]}
        for c in CONVERSATIONS
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "other.jsonl", records)
    read = hf_chat(
        path, tokenizer=tokenizers.marked, val_fraction=0, format="messages", messages_column="dialog",
        message_keys={"role": "speaker", "content": "text"},
        roles={"user": ["customer"], "assistant": ["agent"], "system": "rules"},
    )  # fmt: skip
    messages = hf_chat(
        str(write_chat_jsonl(tmp_path / "m.jsonl")), tokenizer=tokenizers.marked, val_fraction=0
    )
    assert rows(read) == rows(messages)
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"q": "count to three .", "a": "one two three ."}])
    alpaca = hf_chat(
        renamed, tokenizer=tokenizers.marked, val_fraction=0, columns={"instruction": "q", "output": "a"}
    )
    assert rows(alpaca) == rows(
        hf_chat(
            str(write_chat_jsonl(tmp_path / "one.jsonl", [CONVERSATIONS[2]])),
            tokenizer=tokenizers.marked,
            val_fraction=0,
        )
    )
    with pytest.raises(ConfigError, match="data.dataset.format=openai: one of messages, sharegpt"):
        hf_chat(path, tokenizer=tokenizers.marked, format="openai")
    with pytest.raises(
        ConfigError, match=r"other.jsonl line 1: cannot tell the rows' format from their columns \['dialog'\]"
    ):
        hf_chat(path, tokenizer=tokenizers.marked)


def test_sharegpt_tool_turns_map_as_llama_factory_does():
    """function_call -> the assistant's tool call (from its JSON), observation -> a tool turn, a
    system column -> the system turn; a call that is not JSON is one line."""
    row = {
        "system": "you are a helpful assistant .",
        "conversations": [
            {"from": "human", "value": "what is two plus two ?"},
            {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 2, "b": 2}}'},
            {"from": "observation", "value": "4"},
            {"from": "gpt", "value": "two plus two is four ."},
        ],
    }
    sample = ChatFormat("sharegpt", Reading()).sample(row, "f line 1")
    assert [m["role"] for m in sample.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert sample.messages[2]["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    ]
    row["conversations"][1]["value"] = "add(2, 2)"
    with pytest.raises(
        ConfigError, match=r"^f line 1: message 1 \(function_call\) is not the JSON of a call"
    ):
        ChatFormat("sharegpt", Reading()).sample(row, "f line 1")


def split_in_parts(content):
    head, space, tail = content.partition(" ")
    return [{"type": "text", "text": head + space}] + ([{"type": "text", "text": tail}] if tail else [])


def test_content_given_as_text_parts_trains_on_the_text(tokenizers, tmp_path):
    """Issue 48 item 6: a list of OpenAI parts was rendered as its Python repr (the run trained on
    "[{'type': ..." and <unk>s). Its text parts are joined: the tokens, labels and step-1 loss of
    the same conversations with string content."""
    parted = [[{**m, "content": split_in_parts(m["content"])} for m in c] for c in CONVERSATIONS]
    assert all(
        "".join(p["text"] for p in m["content"]) == o["content"]
        for c, oc in zip(parted, CONVERSATIONS)
        for m, o in zip(c, oc)
    )
    read = hf_chat(
        str(write_chat_jsonl(tmp_path / "parts.jsonl", parted)), tokenizer=tokenizers.marked, val_fraction=0
    )
    plain = hf_chat(str(write_chat_jsonl(tmp_path / "m.jsonl")), tokenizer=tokenizers.marked, val_fraction=0)
    assert rows(read) == rows(plain)
    unk = read.tokenizer.unk_token_id
    assert all(unk not in ids for ids, _ in rows(read))
    assert step1_loss(read) == pytest.approx(step1_loss(plain), abs=1e-6)


@pytest.mark.parametrize(
    "message, error",
    [
        (
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}],
            },
            "message 0 holds a content part of type 'image_url'; only text parts",
        ),
        ({"role": "assistant"}, r"message 0 \(assistant\) has no content; give its text"),  # item 7
        ({"role": "assistant", "content": None}, r"message 0 \(assistant\) has no content"),
    ],
)
def test_parts_that_are_not_text_and_messages_without_content_are_one_line(
    tokenizers, tmp_path, message, error
):
    """Issue 48 items 6 and 7: an assistant turn without content was trained as an empty answer."""
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"messages": CONVERSATIONS[2]}) + "\n\n" + json.dumps({"messages": [message]}) + "\n"
    )
    with pytest.raises(ConfigError, match=f"^{path} line 3: {error}") as caught:
        hf_chat(str(path), tokenizer=tokenizers.marked, val_fraction=0)
    assert "\n" not in str(caught.value)
    streamed = hf_chat(str(path), tokenizer=tokenizers.marked, val_fraction=0, streaming=True, shards=1)
    with pytest.raises(ConfigError, match=f"^{path} line 3: {error}"):
        list(Reader(streamed.train, 0, 1, 0, {}))


def test_an_assistant_tool_call_without_content_is_a_turn(tokenizers):
    sample = ChatFormat("messages", Reading()).sample(
        {
            "messages": [
                {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
            ]
        },
        "w",
    )
    assert sample.messages[0]["content"] is None and sample.messages[0]["tool_calls"]


def test_a_stream_of_sharegpt_gives_the_map_style_rows(tokenizers, tmp_path, pack=False):
    path = write_jsonl(tmp_path / "chat.jsonl", [sharegpt(c) for c in CONVERSATIONS])
    mapped = hf_chat(path, tokenizer=tokenizers.plain, val_fraction=0, max_length=64, pack=pack)
    streamed = hf_chat(
        path, tokenizer=tokenizers.plain, val_fraction=0, max_length=64, pack=pack, streaming=True, shards=1
    )
    got = [item for item, _, _ in Reader(streamed.train, 0, 1, 0, {})]
    assert len(got) == len(mapped.train)
    for item, row in zip(got, mapped.train):
        assert {k: v.tolist() for k, v in item.items()} == {k: v.tolist() for k, v in row.items()}
