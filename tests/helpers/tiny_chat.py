"""A tiny chat model and chat data, made locally (no download), for tests of chat fine-tuning.

    from tests.helpers.tiny_chat import write_tiny_llama, write_chat_jsonl

    model_dir = write_tiny_llama(tmp_path / "llama")          # LlamaForCausalLM + its tokenizer
    data = write_chat_jsonl(tmp_path / "chat.jsonl")          # a handful of multi-turn conversations
    # python train.py model=hf_causal_lm model.path={model_dir} data=hf_chat \
    #     data.dataset.data_files={data} loss=model ...

The tokenizer is word-level (the `tokenizers` library, trained on the conversations' words) and
its chat template is Llama-3-like: `<|begin_of_text|>`, a header per turn, `<|eot_id|>` ending
each turn (also the EOS). `generation_markers=True` wraps the assistant's content and its
`<|eot_id|>` in `{% generation %}...{% endgeneration %}`, so
`apply_chat_template(..., return_assistant_tokens_mask=True)` marks them; without the markers
the same template renders the same tokens (the framework then finds the assistant's tokens by
rendering growing prefixes of each conversation).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BOS, EOT, PAD, UNK = "<|begin_of_text|>", "<|eot_id|>", "<|pad|>", "<|unk|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
SPECIAL_TOKENS = [PAD, UNK, BOS, EOT, HEADER_START, HEADER_END]

_ASSISTANT = "{{ message['content'] }}" + EOT
_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    + HEADER_START
    + "{{ message['role'] }}"
    + HEADER_END
    + "\n\n"
    + "{% if message['role'] == 'assistant' %}ASSISTANT{% else %}{{ message['content'] }}"
    + EOT
    + "{% endif %}{% endfor %}"
    + "{% if add_generation_prompt %}"
    + HEADER_START
    + "assistant"
    + HEADER_END
    + "\n\n{% endif %}"
)

CONVERSATIONS: list[list[dict[str, str]]] = [
    [
        {"role": "system", "content": "you are a helpful assistant ."},
        {"role": "user", "content": "what is the capital of france ?"},
        {"role": "assistant", "content": "the capital of france is paris ."},
    ],
    [
        {"role": "user", "content": "name a red fruit ."},
        {"role": "assistant", "content": "an apple is a red fruit ."},
        {"role": "user", "content": "and a yellow one ?"},
        {"role": "assistant", "content": "a banana is yellow ."},
    ],
    [
        {"role": "user", "content": "count to three ."},
        {"role": "assistant", "content": "one two three ."},
    ],
    [
        {"role": "system", "content": "answer in few words ."},
        {"role": "user", "content": "is the sky blue ?"},
        {"role": "assistant", "content": "yes , on a clear day ."},
        {"role": "user", "content": "and at night ?"},
        {"role": "assistant", "content": "it is dark at night ."},
        {"role": "user", "content": "thank you ."},
        {"role": "assistant", "content": "you are welcome ."},
    ],
    [
        {"role": "user", "content": "what do cats say ?"},
        {"role": "assistant", "content": "cats say meow ."},
    ],
    [
        {"role": "user", "content": "say hello ."},
        {"role": "assistant", "content": "hello !"},
        {"role": "user", "content": "say it twice ."},
        {"role": "assistant", "content": "hello hello !"},
    ],
    [
        {"role": "system", "content": "you are a helpful assistant ."},
        {"role": "user", "content": "what is two plus two ?"},
        {"role": "assistant", "content": "two plus two is four ."},
    ],
    [
        {"role": "user", "content": "which is bigger , a cat or a dog ?"},
        {"role": "assistant", "content": "a dog is usually bigger than a cat ."},
    ],
]


def chat_template(generation_markers: bool = True) -> str:
    """The Llama-3-like Jinja chat template, with or without `{% generation %}` markers around the
    assistant's content and end-of-turn token (both render the same text)."""
    assistant = "{% generation %}" + _ASSISTANT + "{% endgeneration %}" if generation_markers else _ASSISTANT
    return _TEMPLATE.replace("ASSISTANT", assistant)


def _words(conversations: list[list[dict[str, str]]]) -> list[str]:
    texts = [m["content"] for c in conversations for m in c]
    return [*texts, "system user assistant"]


def tiny_chat_tokenizer(
    generation_markers: bool = True, conversations: list[list[dict[str, str]]] | None = None
) -> Any:
    """A word-level `PreTrainedTokenizerFast` over the conversations' words (unknown words become
    `<|unk|>`), with bos / eos (`<|eot_id|>`) / pad tokens and the chat template."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        _words(conversations or CONVERSATIONS), trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS)
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOT, pad_token=PAD, unk_token=UNK
    )
    fast.add_special_tokens({"additional_special_tokens": [HEADER_START, HEADER_END]})
    fast.chat_template = chat_template(generation_markers)
    return fast


IM_START, IM_END, NEWLINE = "<|im_start|>", "<|im_end|>", "\n"


def chatml_template(generation_markers: bool = True) -> str:
    """ChatML (Qwen's): `<|im_start|>role\ncontent<|im_end|>\n` per turn; `generation_markers`
    wraps an assistant's content and `<|im_end|>` in `{% generation %}`, leaving the newline after
    it out, as ChatML templates with markers do."""
    assistant = "{{ message['content'] }}" + IM_END
    if generation_markers:
        assistant = "{% generation %}" + assistant + "{% endgeneration %}"
    newline = "{{ '\\n' }}"  # an expression: transformers' trim_blocks would eat a literal one after a tag
    return (
        "{% for message in messages %}"
        + IM_START
        + "{{ message['role'] }}"
        + newline
        + "{% if message['role'] == 'assistant' %}"
        + assistant
        + newline
        + "{% else %}{{ message['content'] }}"
        + IM_END
        + newline
        + "{% endif %}{% endfor %}"
        + "{% if add_generation_prompt %}"
        + IM_START
        + "assistant"
        + newline
        + "{% endif %}"
    )


def tiny_chatml_tokenizer(generation_markers: bool = True) -> Any:
    """The word-level tokenizer of `tiny_chat_tokenizer` with ChatML's special tokens (EOS
    `<|im_end|>`), the newline a token of its own, and `chatml_template`."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        _words(CONVERSATIONS), trainers.WordLevelTrainer(special_tokens=[PAD, UNK, IM_START, IM_END])
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, unk_token=UNK
    )
    fast.add_special_tokens({"additional_special_tokens": [IM_START]})
    fast.add_tokens([NEWLINE])
    fast.chat_template = chatml_template(generation_markers)
    return fast


def tiny_llama(tokenizer: Any, seed: int = 0, hidden_size: int = 32, layers: int = 2) -> Any:
    """A random `LlamaForCausalLM` (fp32, sdpa attention) sized to the tokenizer."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def random_lora(model: Any, **lora: Any) -> Any:
    """`model` with LoRA adapters (`peft.LoraConfig(**lora)`, lora_A drawn from seed 1), their B
    matrices random too, so that the adapters change the model from the first step."""
    import peft
    import torch

    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model


def write_tiny_llama(directory: str | Path, generation_markers: bool = True, seed: int = 0) -> Path:
    """`directory` with a tiny Llama (`save_pretrained`) and its chat tokenizer: what
    `model=hf_causal_lm model.path=DIR` loads, the tokenizer and chat template included."""
    directory = Path(directory)
    tokenizer = tiny_chat_tokenizer(generation_markers)
    tiny_llama(tokenizer, seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_chat_jsonl(
    path: str | Path,
    conversations: list[list[dict[str, str]]] | None = None,
    column: str = "messages",
) -> Path:
    """A JSONL file, one `{column: [{"role", "content"}, ...]}` conversation per line."""
    path = Path(path)
    rows = conversations if conversations is not None else CONVERSATIONS
    path.write_text("".join(json.dumps({column: messages}) + "\n" for messages in rows))
    return path
