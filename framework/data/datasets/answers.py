"""A prompt and its answers tokenized as TRL does (`DPOTrainer`, and `SFTTrainer` on
prompt-completion rows): the answer is what the tokenizer gives for prompt + answer after what it
gives for the prompt alone, nothing cut at the template's generation markers.

* Chat messages: the prompt rendered by the chat template with the generation prompt, and
  prompt + answer rendered whole; the answer's tokens are those of the whole render after the
  prompt's (ChatML's newline after `<|im_end|>` included). `markers=True` keeps only those the
  template's `{% generation %}` markers mark (the assistant's content and end-of-turn token).
* Plain text (strings, no template): the tokenizer's ids of the prompt, and of prompt + answer
  with the end-of-sequence token appended when the answer does not end with it.

Where the prompt's tokens are not a beginning of prompt + answer's (a template that renders the
prompt alone otherwise, tokens merging across the boundary), the answer starts where they
diverge, as in TRL; for a pair, where the first of the two answers diverges.
"""

from __future__ import annotations

from typing import Any


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def templated(
    chat: Any,
    prompt: list[dict[str, Any]],
    answers: list[list[dict[str, Any]]],
    where: str,
    markers: bool,
    tools: Any = None,
) -> list[tuple[list[int], list[bool]]]:
    """Per answer: the tokens of prompt + answer, and which are the answer's (see the module doc).
    `chat` renders (`framework.data.datasets.chat.ChatEncoder`)."""
    before = chat.ids(prompt, where, tools, add_generation_prompt=True)
    wholes = [chat.ids(prompt + answer, where, tools) for answer in answers]
    start = min(common_prefix(before, ids) for ids in wholes)
    out = []
    for answer, ids in zip(answers, wholes):
        if markers:
            _, marked = chat.assistant_tokens(prompt + answer, where, tools)
            out.append((ids, [bool(m) and i >= start for i, m in enumerate(marked)]))
        else:
            out.append((ids, [i >= start for i in range(len(ids))]))
    return out


def plain(tokenizer: Any, prompt: str, answers: list[str]) -> list[tuple[list[int], list[bool]]]:
    """Per answer: the tokens of the text prompt + answer (the end-of-sequence token appended to
    an answer without it), and which are the answer's."""
    eos = getattr(tokenizer, "eos_token", None)
    if eos:
        answers = [a if a.endswith(eos) else a + eos for a in answers]
    before = list(tokenizer(prompt)["input_ids"])
    wholes = [list(tokenizer(prompt + answer)["input_ids"]) for answer in answers]
    start = min(common_prefix(before, ids) for ids in wholes)
    return [(ids, [i >= start for i in range(len(ids))]) for ids in wholes]
