"""A chat row rendered into tokens and labels (`ChatEncoder`), for `data=hf_chat` and the pairs of
`data=hf_preference`: the row's format (`framework.data.datasets.formats`) makes it chat
messages or plain text, the tokenizer's chat template renders the messages.

Labels (`train_on_prompt=True`: every token):

* a conversation (messages, ShareGPT, Alpaca): the tokens the template renders for the
  assistant's turns (its content and its end-of-turn token), -100 elsewhere. A template with
  `{% generation %}` markers says which tokens those are
  (`apply_chat_template(..., return_assistant_tokens_mask=True)`); a template without them: the
  conversation is rendered up to each assistant message with the generation prompt, and up to and
  including it; the tokens between are that turn's. No string search, so any template works whose
  renders of a conversation's beginnings are beginnings of its render (else a one-line error asks
  for the markers).
* prompt-completion rows: the completion's tokens as TRL's `SFTTrainer` takes them
  (`framework.data.datasets.answers`): chat messages, what the template renders for prompt +
  completion after the prompt rendered with the generation prompt (`completion_tokens=markers`:
  only what the markers mark there); strings, plain text, the completion's tokens.

A row longer than `max_length` tokens is cut there (counted, in one line); one left with no label
that counts (cut before its first assistant token, or without an assistant turn) is dropped
(counted, in one line), never kept where it would count nothing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from framework.data.datasets import answers
from framework.data.datasets.cache import fingerprint, tokenizer_fingerprint
from framework.data.datasets.counted import Counted
from framework.data.datasets.formats import ChatFormat, Reading, Sample, chat_format
from framework.data.datasets.hf import load_tokenizer
from framework.data.datasets.sources import WHERE
from framework.data.labels import IGNORE_INDEX, counts_nothing
from framework.errors import ConfigError

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
COMPLETION_TOKENS = ("rendered", "markers")


def chat_tokenizer(tokenizer: str | None, chat_template: str | None = None) -> Any:
    """The tokenizer at `tokenizer` (a directory or a `tokenizers` JSON file) with its chat
    template, or `chat_template` (Jinja text, or a file holding it) in its place. A tokenizer
    without a template reads plain-text rows; chat messages are then a one-line error."""
    if tokenizer in (None, "bytes"):
        raise ConfigError(
            "data=hf_chat needs a tokenizer with a chat template: model.path=DIR holding one, or "
            "data.dataset.tokenizer=DIR"
        )
    tok = load_tokenizer(tokenizer)
    if chat_template:
        tok.chat_template = _template_text(str(chat_template))
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


def completion_tokens_marked(completion_tokens: str) -> bool:
    """`data.dataset.completion_tokens`, checked: True for `markers`."""
    if completion_tokens not in COMPLETION_TOKENS:
        raise ConfigError(
            f"data.dataset.completion_tokens={completion_tokens}: rendered (TRL's: what the template renders "
            "after the prompt) or markers (what its generation markers mark)"
        )
    return completion_tokens == "markers"


class ChatEncoder(Counted):
    """One row -> `(input_ids, labels)` (see the module doc); `([], [])` for one that is dropped.
    Counts what it cut and dropped (`seen`, `truncated`, `drops`). `format` reads the rows (set
    from a file's first row by `read_as`; `reading` says how)."""

    unit = "conversations"

    def __init__(
        self,
        tokenizer: Any,
        messages_column: str | None = None,
        max_length: int = 1024,
        train_on_prompt: bool = False,
        reading: Reading | None = None,
        completion_tokens: str = "rendered",
    ):
        if int(max_length) < 2:
            raise ConfigError(f"data.dataset.max_length={max_length}: a conversation needs at least 2 tokens")
        self.tok, self.max_length, self.train_on_prompt = tokenizer, int(max_length), bool(train_on_prompt)
        self.reading = reading or Reading(messages_column=messages_column)
        self.format = ChatFormat(self.reading.format or "messages", self.reading)
        self.marked = bool(GENERATION_MARKER.search(template_of(tokenizer)))
        self.completion_tokens, self.markers = completion_tokens, completion_tokens_marked(completion_tokens)
        super().__init__()

    def read_as(self, where: str, row: dict[str, Any], path: Path) -> str:
        """Read the rows of `path` in the format of its first row `row` (at `where`); the line
        that says so."""
        self.format = chat_format(row, self.reading, where)
        return self.format.describe(path, row)

    def fingerprint(self) -> str:
        """What the rows depend on besides a file's bytes (the key of their cache)."""
        return fingerprint(
            "chat",
            self.format.key(),
            self.max_length,
            self.train_on_prompt,
            self.completion_tokens,
            tokenizer_fingerprint(self.tok),
        )

    def __call__(self, example: dict[str, Any]) -> tuple[list[int], list[int]]:
        """A streamed row (its file and line under `WHERE`); says the first drop and every
        doubling of the count in one line, since a stream is never counted to its end."""
        out = self.encode(example, str(example.get(WHERE, "a streamed row")))
        if not out[0]:
            self.say_dropped_so_far()
        return out

    def encode_row(self, row: dict[str, Any], where: str) -> dict[str, np.ndarray] | None:
        """The row's `{input_ids, labels}` arrays, None when it is dropped."""
        ids, labels = self.encode(row, where)
        if not ids:
            return None
        return {"input_ids": np.asarray(ids, dtype=np.int64), "labels": np.asarray(labels, dtype=np.int64)}

    def encode(self, example: dict[str, Any], where: str) -> tuple[list[int], list[int]]:
        """The row `example` (of the file and line `where`) as tokens and labels."""
        sample = self.format.sample(example, where)
        self.seen += 1
        ids, mask = self.labelled(sample, where)
        labels = list(ids) if self.train_on_prompt else [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
        if len(ids) > self.max_length:
            self.truncated += 1
            ids, labels = ids[: self.max_length], labels[: self.max_length]
        if counts_nothing(labels):
            self.drop()
            return [], []
        return ids, labels

    def labelled(self, sample: Sample, where: str) -> tuple[list[int], list[bool]]:
        """A sample's tokens, and which are learned (see the module doc)."""
        if sample.text is not None:
            return answers.plain(self.tok, sample.text[0], [sample.text[1]])[0]
        messages = sample.messages or []
        if sample.prompt is not None:
            prompt, completion = messages[: sample.prompt], messages[sample.prompt :]
            return answers.templated(self, prompt, [completion], where, self.markers, sample.tools)[0]
        return self.assistant_tokens(messages, where, sample.tools)

    def assistant_tokens(
        self, messages: list[dict[str, Any]], where: str, tools: Any = None
    ) -> tuple[list[int], list[bool]]:
        """The conversation's tokens, and which are the assistant's (see the module doc)."""
        if self.marked:
            out = self._render(messages, where, tools, return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        ids = self.ids(messages, where, tools)
        mask = [False] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.ids(messages[:i], where, tools, add_generation_prompt=True)
            through = self.ids(messages[: i + 1], where, tools)
            if through[: len(before)] != before or ids[: len(through)] != through:
                raise ConfigError(
                    f"{where}: the chat template renders the conversation up to message {i} as other "
                    "tokens than the whole conversation's beginning, so its assistant tokens cannot be "
                    "told apart; use a template with {% generation %} markers (data.dataset.chat_template=FILE)"
                )
            mask[len(before) : len(through)] = [True] * (len(through) - len(before))
        return ids, mask

    def ids(self, messages: list[dict[str, Any]], where: str, tools: Any = None, **kwargs: Any) -> list[int]:
        """The tokens the chat template renders for `messages`."""
        return list(self._render(messages, where, tools, **kwargs)["input_ids"])

    def _render(self, messages: list[dict[str, Any]], where: str, tools: Any, **kwargs: Any) -> Any:
        if not template_of(self.tok):
            raise ConfigError(
                f"{where}: the tokenizer {getattr(self.tok, 'name_or_path', '')} has no chat template: give one "
                "with data.dataset.chat_template=FILE.jinja (plain-text rows need none)"
            )
        if tools is not None:
            kwargs["tools"] = tools
        try:
            return self.tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
        except ConfigError:
            raise
        except Exception as exc:  # the template's own checks (roles must alternate, ...)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"{where}: the chat template cannot render this conversation: {first}") from exc

    def why(self, reason: str = "") -> str:
        """Why a conversation is dropped, in words."""
        return (
            f"no assistant token within max_length={self.max_length} (cut before the first, or no "
            "assistant turn); data.dataset.max_length to change"
        )
