"""A small decoder-only transformer (GPT) that splits into pipeline stages.

The model is a straight sequence of layers — token embedding, position embedding, blocks,
final norm, output head tied to the token embedding — so `pipeline_layers()` can hand the
same layers to DeepSpeed's PipelineModule, with the embedding/head tie kept across stages.
Packed rows (`position_ids` restarting at each document, `framework.data.bins`) attend within
their documents (`framework.integrations.packed`); the pipeline stages read plain rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.data.labels import IGNORE_INDEX
from framework.integrations.packed import causal_document_mask, documents


class TokenEmbedding(nn.Embedding):
    """Token ids -> vectors; also the output head (`logits`), sharing its weight."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Project hidden states onto the vocabulary with the embedding matrix."""
        return F.linear(x, self.weight)


def _tied_head(module: TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    return module.logits(x)


class PositionEmbedding(nn.Module):
    """Adds learned position vectors (and dropout) to token vectors."""

    def __init__(self, block_size: int, n_embd: int, dropout: float = 0.0):
        super().__init__()
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, C) token vectors; `position_ids` (B, T) or (1, T), default 0 .. T-1."""
        pos = torch.arange(x.shape[1], device=x.device) if position_ids is None else position_ids
        return self.drop(x + self.wpe(pos))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each residual."""

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.proj.residual_projection = True  # type: ignore[assignment]
        self.mlp[2].residual_projection = True  # type: ignore[assignment]
        self.dropout = dropout
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C); `mask` (B, 1, T, T) boolean, True where a position may attend
        another (default: causal). Under tensor parallelism `qkv` yields this rank's heads only
        (a column split of 3 parts), and `proj` sums the ranks' outputs (a row split)."""
        b, t, c = x.shape
        head_dim = c // self.n_head
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=2)
        q, k, v = (z.view(b, t, -1, head_dim).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """Decoder-only transformer over `vocab_size` tokens with context `block_size`.

    `tensor_parallel_plan` says how its linears split under tensor parallelism (Megatron's
    layout: heads and the MLP's hidden units split, one all-reduce after attention and one after
    the MLP; the tied embedding / head stays whole). See `framework.plan.strategy.TensorParallel`."""

    tensor_parallel_plan = {
        "blocks.*.qkv": "column:3",
        "blocks.*.proj": "row",
        "blocks.*.mlp.0": "column",
        "blocks.*.mlp.2": "row",
    }

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.vocab_size, self.block_size, self.n_embd, self.n_layer = vocab_size, block_size, n_embd, n_layer
        self.n_head = n_head
        self.wte = TokenEmbedding(vocab_size, n_embd)
        self.pos = PositionEmbedding(block_size, n_embd, dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        # Only through apply(): under deepspeed.zero.Init the sub-modules' parameters are already
        # partitioned here, and DeepSpeed gathers them for Module.apply (a plain loop over
        # named_parameters() would write into empty shards).
        self.residual_std = 0.02 / math.sqrt(2 * n_layer)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            # GPT-2's scaled init of the projections that write into the residual stream
            std = self.residual_std if getattr(module, "residual_projection", False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> next-token logits (B, T, vocab_size). Packed rows (`position_ids`
        restarting at each document) attend within their documents only."""
        return self.wte.logits(self.hidden_states(idx, position_ids))

    def hidden_states(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> what the output head reads (B, T, n_embd); with `output_head`, what
        a loss that applies the head itself in chunks needs (`framework.methods.chunked`)."""
        x = self.pos(self.wte(idx), position_ids)
        mask = None
        if position_ids is not None and documents(position_ids) is not None:
            mask = causal_document_mask(position_ids.expand(idx.shape[0], -1))
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_f(x)

    def output_head(self) -> nn.Module:
        """The output head: the token embedding, whose weight projects onto the vocabulary."""
        return self.wte

    def pipeline_layers(self) -> list[Any]:
        """The model as pipeline layers: the embedding appears twice as a tied layer (input
        embedding on the first stage, output head on the last); the rest are this model's own
        modules, so a pipeline starts from exactly these weights."""
        from framework.backend.pipeline import tied_layer

        args = (self.vocab_size, self.n_embd)
        return [
            tied_layer("wte", TokenEmbedding, *args),
            self.pos,
            *self.blocks,
            self.ln_f,
            tied_layer("wte", TokenEmbedding, *args, forward_fn=_tied_head),
        ]


class LMLoss(nn.Module):
    """Cross-entropy of next-token logits (B, T, V) against targets (B, T); targets equal to
    `ignore_index` (padding) are not counted."""

    ignore_index = IGNORE_INDEX

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss per counted token, in nats."""
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=self.ignore_index
        )
