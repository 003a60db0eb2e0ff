"""Chat fine-tuning data from your own JSONL / Parquet files: conversations rendered by the
tokenizer's chat template, labels on the assistant's tokens only. Nothing is downloaded.

    python train.py model=hf_causal_lm model.path=DIR data=hf_chat \\
        data.dataset.data_files=chat.jsonl loss=model

Each row holds a conversation, `{"messages": [{"role": "user", "content": ...}, {"role":
"assistant", ...}, ...]}` (`messages_column`). The tokenizer (the model directory's, or
`tokenizer=DIR`) renders it with its chat template (or `chat_template`, a Jinja string or file).
Labels are the tokens the template renders for the assistant's turns (its content and its
end-of-turn token), -100 elsewhere; `train_on_prompt=True` labels every token:

* a template with `{% generation %}` markers says which tokens those are
  (`apply_chat_template(..., return_assistant_tokens_mask=True)`);
* a template without them: the conversation is rendered up to each assistant message with the
  generation prompt, and up to and including it; the tokens between are that turn's. No string
  search, so any template works whose renders of a conversation's beginnings are beginnings of
  its render (else a one-line error asks for the markers).

A conversation longer than `max_length` tokens is cut there (counted, in one line); one left with
no label that counts (cut before its first assistant token, or without an assistant turn) is
dropped (counted, in one line), never kept where it would count nothing. Rows are
`{"input_ids", "labels", "attention_mask"}`, padded per batch (pad token, labels -100), or with
`pack=True` blocks of `max_length` tokens holding whole conversations kept apart (position ids
restart, `framework.data.packing`), the same per-token loss as unpacked. `streaming=True` reads
the files as a `framework.data.streams.Stream` (never loaded whole, exact resume).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np

from framework.data.datasets.classification import Splits
from framework.data.datasets.counted import Counted
from framework.data.datasets.hf import EveryNth, TokenizedSplits, load_local, load_tokenizer, with_tokenizer
from framework.data.datasets.text_classification import PadCollator
from framework.data.labels import IGNORE_INDEX, counts_nothing
from framework.data.packing import Packer, packed
from framework.data.streams import DEFAULT_SHARDS, Stream
from framework.errors import ConfigError

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
WHERE = "__where__"  # a streamed row's file and line, for errors


def chat_tokenizer(tokenizer: str | None, chat_template: str | None = None) -> Any:
    """The tokenizer at `tokenizer` (a directory or a `tokenizers` JSON file) with its chat
    template, or `chat_template` (Jinja text, or a file holding it) in its place."""
    if tokenizer in (None, "bytes"):
        raise ConfigError(
            "data=hf_chat needs a tokenizer with a chat template: model.path=DIR holding one, or "
            "data.dataset.tokenizer=DIR"
        )
    tok = load_tokenizer(tokenizer)
    if chat_template:
        tok.chat_template = _template_text(str(chat_template))
    if not template_of(tok):
        raise ConfigError(
            f"the tokenizer {tokenizer} has no chat template: give one with data.dataset.chat_template=FILE.jinja"
        )
    return tok


def template_of(tokenizer: Any) -> str:
    """The tokenizer's chat template (its default one, where it has several), or ""."""
    template = getattr(tokenizer, "chat_template", None)
    return (template.get("default") if isinstance(template, dict) else template) or ""


def _template_text(template: str) -> str:
    """Jinja text as it is; else the file it names."""
    if "{{" in template or "{%" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"data.dataset.chat_template={template}: no such file (or give the Jinja text)"
        )
    return path.read_text()


class ChatEncoder(Counted):
    """One conversation -> `(input_ids, labels)` (see the module doc); `([], [])` for one that is
    dropped. Counts what it cut and dropped (`seen`, `truncated`, `dropped`)."""

    unit = "conversations"

    def __init__(self, tokenizer: Any, messages_column: str, max_length: int, train_on_prompt: bool):
        if int(max_length) < 2:
            raise ConfigError(f"data.dataset.max_length={max_length}: a conversation needs at least 2 tokens")
        self.tok, self.column = tokenizer, messages_column
        self.max_length, self.train_on_prompt = int(max_length), bool(train_on_prompt)
        self.marked = bool(GENERATION_MARKER.search(template_of(tokenizer)))
        super().__init__()

    def __call__(self, example: dict[str, Any]) -> tuple[list[int], list[int]]:
        """A streamed row (its file and line under `WHERE`); says the first drop and every
        doubling of the count in one line, since a stream is never counted to its end."""
        out = self.encode(example, str(example.get(WHERE, "a streamed row")))
        if not out[0]:
            self.say_dropped_so_far()
        return out

    def encode(self, example: dict[str, Any], where: str) -> tuple[list[int], list[int]]:
        """The conversation of `example` (a row of the file and line `where`)."""
        messages = self.messages(example, where)
        self.seen += 1
        if self.train_on_prompt:
            ids = self._ids(messages, where)
            labels = list(ids)
        else:
            ids, mask = self.assistant_tokens(messages, where)
            labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
        if len(ids) > self.max_length:
            self.truncated += 1
            ids, labels = ids[: self.max_length], labels[: self.max_length]
        if counts_nothing(labels):
            self.dropped += 1
            return [], []
        return ids, labels

    def messages(self, example: dict[str, Any], where: str) -> list[dict[str, Any]]:
        """The row's messages, checked (a one-line error naming `where`); keys a table filled
        with None for this row (another row had them) are left out, content excepted."""
        messages = example.get(self.column)
        if messages is None:
            present = sorted(k for k, v in example.items() if v is not None and k != WHERE)
            raise ConfigError(
                f"{where}: no '{self.column}' in the row (it has {present}); "
                "data.dataset.messages_column=NAME names the conversations"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ConfigError(
                f"{where}: '{self.column}' must be a list of {{role, content}} messages, not {type(messages).__name__}"
            )
        for j, message in enumerate(messages):
            if not isinstance(message.get("role"), str):
                raise ConfigError(
                    f"{where}: message {j} has role {message.get('role')!r}; a role is a string "
                    "(system, user, assistant, ...)"
                )
        return [{k: v for k, v in m.items() if v is not None or k == "content"} for m in messages]

    def assistant_tokens(self, messages: list[dict[str, Any]], where: str) -> tuple[list[int], list[bool]]:
        """The conversation's tokens, and which are the assistant's (see the module doc)."""
        if self.marked:
            out = self._render(messages, where, return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        ids = self._ids(messages, where)
        mask = [False] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._ids(messages[:i], where, add_generation_prompt=True)
            through = self._ids(messages[: i + 1], where)
            if through[: len(before)] != before or ids[: len(through)] != through:
                raise ConfigError(
                    f"{where}: the chat template renders the conversation up to message {i} as other "
                    "tokens than the whole conversation's beginning, so its assistant tokens cannot be "
                    "told apart; use a template with {% generation %} markers (data.dataset.chat_template=FILE)"
                )
            mask[len(before) : len(through)] = [True] * (len(through) - len(before))
        return ids, mask

    def _ids(self, messages: list[dict[str, Any]], where: str, **kwargs: Any) -> list[int]:
        return list(self._render(messages, where, **kwargs)["input_ids"])

    def _render(self, messages: list[dict[str, Any]], where: str, **kwargs: Any) -> Any:
        try:
            return self.tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
        except ConfigError:
            raise
        except Exception as exc:  # the template's own checks (roles must alternate, ...)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"{where}: the chat template cannot render this conversation: {first}") from exc

    def why(self) -> str:
        """Why a conversation is dropped, in words."""
        return (
            f"no assistant token within max_length={self.max_length} (cut before the first, or no "
            "assistant turn); data.dataset.max_length to change"
        )


def _paths(data_files: Any, key: str = "data_files") -> list[Path]:
    names = [data_files] if isinstance(data_files, (str, Path)) else list(data_files)
    paths = [Path(str(f)).expanduser() for f in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"data.dataset.{key}: no such file: {', '.join(missing)}")
    return paths


def _builder(path: Path, builder: str | None) -> str:
    return builder or ("parquet" if path.suffix.lower() == ".parquet" else "json")


def _where(path: Path, builder: str, index: int) -> str:
    return f"{path} {'line' if builder == 'json' else 'row'} {index + 1}"


def _encode_files(
    encoder: ChatEncoder, paths: list[Path], builder: str | None
) -> list[tuple[list[int], list[int]]]:
    """Every kept conversation of the files, in order."""
    kept = []
    for path in paths:
        kind = _builder(path, builder)
        rows = load_local(kind, [path])
        for i, example in enumerate(rows):
            ids, labels = encoder.encode(example, _where(path, kind, i))
            if ids:
                kept.append((ids, labels))
    return kept


class ChatRows:
    """A stream's shard transform for unpacked chat: each kept conversation one row."""

    def __init__(self, shards: int, encoder: ChatEncoder):
        self.shards, self.encoder = shards, encoder

    def feed(self, position: int, example: Any, offset: int = 0) -> list[tuple[Any, tuple[int, int]]]:
        """The conversation's row (nothing when it is dropped)."""
        ids, labels = self.encoder(example)
        return [(_row(ids, labels), (position + self.shards, 0))] if ids else []

    def flush(self) -> list[tuple[Any, tuple[int, int]]]:
        """Nothing is held back."""
        return []


def _row(ids: list[int], labels: list[int]) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.asarray(ids, dtype=np.int64),
        "labels": np.asarray(labels, dtype=np.int64),
        "attention_mask": np.ones(len(ids), dtype=np.int64),
    }


def pack_conversations(
    conversations: list[tuple[list[int], list[int]]], block_size: int, pad_id: int
) -> list[dict[str, np.ndarray]]:
    """Whole conversations packed into blocks of `block_size` tokens, kept apart."""
    packer = Packer(1, _as_document, block_size, eos_id=pad_id, keep_apart=True, pad_id=pad_id)
    blocks = [b for i, c in enumerate(conversations) for b, _ in packer.feed(i, c)]
    return blocks + [b for b, _ in packer.flush()]


def _as_document(conversation: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
    return conversation


def _as_dataset(rows: list[dict[str, np.ndarray]]) -> Any:
    import datasets

    return datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]}).with_format("torch")


def hf_chat(
    data_files: Any,
    messages_column: str = "messages",
    tokenizer: str | None = None,
    chat_template: str | None = None,
    max_length: int = 1024,
    train_on_prompt: bool = False,
    pack: bool = False,
    val_fraction: float = 0.1,
    validation_files: Any = None,
    split_seed: int = 0,
    builder: str | None = None,
    streaming: bool = False,
    shards: int = DEFAULT_SHARDS,
    seed: int = 0,
) -> TokenizedSplits:
    """Conversations of local JSONL / Parquet files (`builder` from the suffix) -> rows whose
    labels are the assistant's tokens (see the module doc). Validation: `validation_files`, else
    `val_fraction` of the conversations (a fixed split by `split_seed`; streamed, every
    1/val_fraction-th); 0: none."""
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ConfigError(f"data.dataset.val_fraction={val_fraction}: must be in [0, 1)")
    tok = chat_tokenizer(tokenizer, chat_template)
    pad = _pad_id(tok)
    encoder = functools.partial(ChatEncoder, tok, messages_column, max_length, train_on_prompt)
    paths = _paths(data_files)
    held_out = _paths(validation_files, "validation_files") if validation_files is not None else None
    collate = None if pack else PadCollator(pad)
    if streaming:
        every = round(1 / val_fraction) if val_fraction else 0
        train, valid = _streams(encoder, paths, held_out, builder, every, pack, shards, seed)
        return with_tokenizer(Splits(train, valid), tok, collate_fn=collate)
    counted = encoder()
    conversations = _encode_files(counted, paths, builder)
    counted.report("training " if held_out else "")
    if not conversations:
        raise ConfigError(f"data.dataset.data_files: no conversation left to learn from: {counted.why()}")
    validation: list[tuple[list[int], list[int]]] = []
    if held_out is not None:
        checked = encoder()
        validation = _encode_files(checked, held_out, builder)
        checked.report("validation ")
    elif val_fraction:
        order = np.random.default_rng(split_seed).permutation(len(conversations))
        chosen = set(order[: int(np.ceil(val_fraction * len(conversations)))].tolist())
        validation = [c for i, c in enumerate(conversations) if i in chosen]
        conversations = [c for i, c in enumerate(conversations) if i not in chosen]

    def rows(part: list[tuple[list[int], list[int]]]) -> Any:
        if not part:
            return None
        return _as_dataset(pack_conversations(part, max_length, pad) if pack else [_row(*c) for c in part])

    return with_tokenizer(Splits(rows(conversations), rows(validation)), tok, collate_fn=collate)


class _Where:
    """Tags a streamed row with its file and line (picklable, as a stream's reader copies its source)."""

    def __init__(self, path: Path, builder: str):
        self.path, self.builder = path, builder

    def __call__(self, example: dict[str, Any], index: int) -> dict[str, Any]:
        return {WHERE: _where(self.path, self.builder, index)}


def _streams(
    encoder: Any, paths: list[Path], held_out: list[Path] | None, builder: str | None, every: int, pack: bool,
    shards: int, seed: int,
) -> tuple[Stream, Stream | None]:  # fmt: skip
    """The training and validation streams of the files (see `hf_chat`): `every` n-th conversation
    validates unless `held_out` files do (0: none)."""
    import datasets

    def read(files: list[Path]) -> Any:
        parts = []
        for path in files:
            kind = _builder(path, builder)
            part = load_local(kind, [path], streaming=True)
            parts.append(part.map(_Where(path, kind), with_indices=True))
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)

    def stream(data: Any) -> Stream:
        chat = encoder()
        pad = _pad_id(chat.tok)
        if pack:
            transform = packed(chat, chat.max_length, pad, keep_apart=True, pad_id=pad)
            return Stream(data, transform, shards=shards, seed=seed, info={"tokenizer": chat.tok})
        rows = functools.partial(ChatRows, encoder=chat)
        return Stream(
            data, rows, shards=shards, seed=seed, collate_fn=PadCollator(pad), info={"tokenizer": chat.tok}
        )

    if held_out is not None:
        return stream(read(paths)), stream(read(held_out))
    if not every:
        return stream(read(paths)), None
    train = read(paths).filter(EveryNth(every, held_out=False), with_indices=True)
    valid = read(paths).filter(EveryNth(every, held_out=True), with_indices=True)
    return stream(train), stream(valid)


def _pad_id(tok: Any) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
