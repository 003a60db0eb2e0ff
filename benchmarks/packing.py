"""Packing chat without padding: the pad share of the old greedy blocks against best-fit-decreasing
padding-free rows, and the real (unpadded) tokens per second of training on each.

The set of issue 50: conversations of lognormal lengths (median 200 tokens, at most 2000, seeded),
packed within `max_length` 2048. "greedy blocks" is `pack=true` before (whole conversations in
order into fixed blocks, padded: `framework.data.packing.Packer`); "best-fit decreasing" is
`pack=true` now (`framework.data.bins`, rows padded only to a batch's longest). Training: a tiny
Llama (sdpa, fp32, AdamW), the documents kept apart by `framework.integrations.packed`, over the
same leading share of the set's tokens on both sides, one process on the CPU.

    python -m benchmarks.packing [--quick | --smoke]
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import parse_args, print_table, write

SIZES = {  # conversations, median, longest, max_length, hidden, micro-batch, training tokens (about)
    "smoke": (60, 40, 200, 256, 32, 2, 1500),
    "quick": (500, 200, 2000, 2048, 64, 2, 40000),
    "full": (500, 200, 2000, 2048, 64, 2, 120000),
}
VOCAB = 2048


def conversations(count: int, median: int, longest: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of `count` conversations, lognormal lengths; the first token is not learned."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 1.0, count), 8, longest).astype(int)
    out = []
    for n in lengths:
        ids = rng.integers(2, VOCAB, int(n)).tolist()
        out.append((ids, [-100, *ids[1:]]))
    return out


def greedy_blocks(docs: list[tuple[list[int], list[int]]], max_length: int) -> list[dict[str, Any]]:
    from framework.data.packing import Packer

    packer = Packer(1, lambda d: d, max_length, eos_id=0, keep_apart=True, pad_id=0)
    blocks = [b for i, d in enumerate(docs) for b, _ in packer.feed(i, d)]
    return blocks + [b for b, _ in packer.flush()]


def batches(rows: list[dict[str, Any]], micro: int) -> list[dict[str, torch.Tensor]]:
    from framework.data.bins import PackedCollator

    collate = PackedCollator(0)
    order = np.random.default_rng(0).permutation(len(rows))  # as a loader shuffles: not longest first
    rows = [rows[i] for i in order]
    return [collate(rows[i : i + micro]) for i in range(0, len(rows), micro)]


def pad_share(batched: list[dict[str, torch.Tensor]], real: int) -> float:
    return 1 - real / sum(b["input_ids"].numel() for b in batched)


def train(batched: list[dict[str, torch.Tensor]], hidden: int, budget: int) -> tuple[int, float]:
    """(real tokens, seconds) of training steps over the leading batches until `budget` real
    tokens (the first step, a warm-up, not timed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from framework.integrations.packed import keep_documents_apart

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = keep_documents_apart(LlamaForCausalLM(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    real, seconds = 0, 0.0
    for i, batch in enumerate(batched):
        start = time.perf_counter()
        model(**batch, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:
            seconds += time.perf_counter() - start
            real += int((batch["input_ids"] != 0).sum())  # conversations use ids >= 2; 0 pads
            if real >= budget:
                break
    return real, seconds


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv)
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    count, median, longest, max_length, hidden, micro, budget = SIZES[size]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    docs = conversations(count, median, longest)
    real = sum(len(ids) for ids, _ in docs)
    from framework.data.bins import pack_rows

    sides = {
        "greedy blocks (before)": greedy_blocks(docs, max_length),
        "best-fit decreasing": pack_rows(docs, max_length),
    }
    best: dict[str, float] = {}
    for _ in range(2):  # the sides take turns; each keeps its faster pass (a shared machine's load)
        for name, packed in sides.items():
            tokens, seconds = train(batches(packed, micro), hidden, budget)
            best[name] = max(best.get(name, 0.0), tokens / seconds if seconds else 0.0)
    rows = []
    for name, packed in sides.items():
        batched = batches(packed, micro)
        rows.append(
            {
                "packing": name,
                "rows": len(packed),
                "micro_batch": micro,
                "pad_share": pad_share(batched, real),
                "pad_share_one_row": pad_share(batches(packed, 1), real),
                "tokens_per_s": best[name],
            }
        )
    for row in rows:
        row["tokens_per_s_over_greedy"] = (
            row["tokens_per_s"] / rows[0]["tokens_per_s"] if rows[0]["tokens_per_s"] else 0.0
        )
    notes = {
        "conversations": count,
        "median": median,
        "longest": longest,
        "max_length": max_length,
        "hidden": hidden,
    }
    write("packing", rows, notes, args.out_dir)
    print_table(f"packing ({size}): {count} conversations, max_length {max_length}", rows)


if __name__ == "__main__":
    main()
