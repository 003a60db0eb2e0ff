"""A tiny Llama in a `save_pretrained` directory and a LoRA run on it through `Engine.fit`, in
this process (a few seconds), for tests of what an adapter run's checkpoint records and exports.

    base = write_base(tmp_path / "base")                 # seed 0; seed=1: same shapes, other weights
    ckpts = train_adapter(base, tmp_path / "ckpts")      # LoRA r=4, 3 SGD steps, ZeRO-0
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

V, T = 64, 16  # vocabulary and sequence length


def write_base(directory: str | Path, seed: int = 0, hidden_size: int = 32) -> Path:
    """A random `LlamaForCausalLM` saved with `save_pretrained` (its tokenizer is not needed here)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return Path(directory)


def lora(alpha: int = 8, dropout: float = 0.0, use_dora: bool = False):
    """The adapter the tests train: r=4 on every linear layer."""
    import peft

    return peft.LoraConfig(
        r=4,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
        use_dora=use_dora,
    )


def adapter_engine(base: Path, stage: int = 0, **adapter):
    """An Engine that trains `lora()` on the model of `base` (loaded from the directory, as
    `model=hf_causal_lm model.path=DIR` does)."""
    import transformers

    from framework import Engine, Strategy

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    return Engine(
        model,
        "model",
        functools.partial(torch.optim.SGD, lr=0.5),
        strategy=Strategy(sharding={"stage": stage}),
        adapter=lora(**adapter),
    )


def token_data(rows: int = 12) -> list[dict[str, torch.Tensor]]:
    """Random token sequences, each its own label."""
    tokens = torch.randint(0, V, (rows, T), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": t, "labels": t.clone()} for t in tokens]


def train_adapter(base: Path, save_dir: Path, epochs: int = 1) -> Path:
    """Train `lora()` on `base` for `epochs` epochs of `token_data()` (3 steps each), checkpoints in `save_dir`."""
    adapter_engine(base).fit(token_data(), batch_size=4, epochs=epochs, shuffle=False, save_dir=str(save_dir))
    return Path(save_dir)
