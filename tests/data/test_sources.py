"""Files that cannot be read (framework.data.datasets.sources), issue 48 item 14: a 0-byte file
ended in `StopIteration:`, non-UTF-8 bytes in a `UnicodeDecodeError` without file or line, a
malformed JSON line in a generic `DatasetGenerationError` (the row counted from 0 in a log line).
Now each is one line naming the file, the line (from 1) and what is wrong, for chat and pairs
data, loaded or streamed; and a file holding one JSON array reads as its JSON Lines twin."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from framework import ConfigError  # noqa: E402
from framework.data.datasets.chat import hf_chat  # noqa: E402
from framework.data.datasets.preference import hf_preference  # noqa: E402
from framework.data.streams import Reader  # noqa: E402
from tests.data.conftest import rows  # noqa: E402
from tests.helpers.tiny_chat import CONVERSATIONS, write_chat_jsonl  # noqa: E402

GOOD = json.dumps({"messages": CONVERSATIONS[0]}).encode() + b"\n"
CASES = {
    "empty": (b"", r"line 1: the file is empty \(0 bytes\)"),
    "latin-1": (
        GOOD + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n',
        r"line 2: not UTF-8 text \(byte 0xe9 at column 47\); save the file as UTF-8",
    ),
    "cut": (
        GOOD + GOOD + b'{"messages": [{"role": "user",\n',
        r"line 3: not JSON \(Expecting .* at column 31\)",
    ),
    "not an object": (GOOD + b"[1, 2]\n", r"line 2: a JSON list where a row is an object"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("streaming", [False, True])
def test_an_unreadable_file_is_one_line_naming_it_and_the_line(tokenizers, tmp_path, case, streaming):
    content, error = CASES[case]
    path = tmp_path / "chat.jsonl"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"^{path} {error}") as caught:
        splits = hf_chat(
            str(path), tokenizer=tokenizers.marked, val_fraction=0, streaming=streaming, shards=1
        )
        list(Reader(splits.train, 0, 1, 0, {}))
    assert "\n" not in str(caught.value)


def test_an_unreadable_pairs_file_is_one_line(tokenizers, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": \n')
    with pytest.raises(ConfigError, match=f"^{path} line 2: not JSON"):
        hf_preference(str(path), tokenizer=tokenizers.marked, val_fraction=0)


def test_a_file_holding_a_json_array_reads_as_its_json_lines(tokenizers, tmp_path):
    """LLaMA-Factory's data files are JSON arrays; an error in one names the line it is on."""
    lines = hf_chat(str(write_chat_jsonl(tmp_path / "m.jsonl")), tokenizer=tokenizers.marked, val_fraction=0)
    array = tmp_path / "m.json"
    array.write_text(json.dumps([{"messages": c} for c in CONVERSATIONS], indent=1))
    assert rows(hf_chat(str(array), tokenizer=tokenizers.marked, val_fraction=0)) == rows(lines)
    text = array.read_text().splitlines()
    line = next(i for i, t in enumerate(text, 1) if '"role": "user"' in t and i > 20)
    text[line - 1] = text[line - 1].replace('"role": "user"', '"role": 3')
    array.write_text("\n".join(text))
    with pytest.raises(ConfigError, match=r"m.json line \d+: message \d has role 3"):
        hf_chat(str(array), tokenizer=tokenizers.marked, val_fraction=0)
