"""Pairs data (framework.data.datasets.preference) as TRL's `DPOTrainer` reads it: an implicit
prompt (the common beginning of chosen and rejected) gives the explicit prompt's rows and DPO
losses; pairs of strings are raw text; every pair is tokenized as the rendered prompt and the
rendered prompt + answer, so DPO with LoRA on a ChatML template with generation markers equals
TRL over 10 steps (`completion_tokens=markers` cuts at the markers instead); a pair whose answers
are the same tokens is counted and dropped."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from framework import ConfigError  # noqa: E402
from framework.data.datasets.preference import (
    hf_preference,  # noqa: E402
    implicit_prompt,  # noqa: E402
)
from framework.methods import DPO  # noqa: E402
from tests.helpers.tiny_chat import NEWLINE, tiny_llama  # noqa: E402
from tests.helpers.tiny_pairs import PAIRS, write_pairs_jsonl  # noqa: E402

LR = 0.5


def as_messages(pair):
    """A pair of the helper's as TRL's conversational rows: every part chat messages."""
    return {k: [{"role": "user" if k == "prompt" else "assistant", "content": v}] if isinstance(v, str) else v for k, v in pair.items()}  # fmt: skip


def implicit(pair):
    """The pair with its prompt inside chosen and rejected (TRL's implicit prompt)."""
    return {"chosen": pair["prompt"] + pair["chosen"], "rejected": pair["prompt"] + pair["rejected"]}


def pair_rows(splits):
    return [{k: v.tolist() for k, v in row.items()} for row in splits.train]


def host(model):
    """What a step uses of the Engine, on one process without DeepSpeed."""
    runtime = SimpleNamespace(frozen=lambda reference: reference.requires_grad_(False).eval())
    return SimpleNamespace(model=model, module=model, output_key=None, runtime=runtime)


def dpo_losses(model, splits, steps):
    """Our DPO's loss at each of `steps` SGD steps on one batch of every pair."""
    dpo = DPO(beta=0.1)
    dpo.attach(host(model))  # as an Engine taking it: a frozen copy, or the adapters switched off
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    batch, losses = splits.collate_fn([splits.train[i] for i in range(len(splits.train))]), []
    for _ in range(steps):
        loss = dpo(host(model), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def lora(tokenizer, trained: bool = False):
    """A tiny Llama with fresh LoRA adapters (`trained`: their B matrices random, so the policy
    differs from its reference, the base, from the first step)."""
    peft = pytest.importorskip("peft", reason="needs the hf extra: pip install -e '.[hf]'")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(tiny_llama(tokenizer, seed=0), config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if trained and "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def test_an_implicit_prompt_gives_the_explicit_prompts_rows_and_dpo_losses(tokenizers, tmp_path, capsys):
    """Issue 49: pairs with only chosen and rejected (TRL's implicit prompt) were refused."""
    pairs = [as_messages(p) for p in PAIRS]
    explicit = hf_preference(
        str(write_pairs_jsonl(tmp_path / "e.jsonl", pairs)), tokenizer=tokenizers.marked, val_fraction=0
    )
    path = write_pairs_jsonl(tmp_path / "i.jsonl", [implicit(p) for p in pairs])
    found = hf_preference(str(path), tokenizer=tokenizers.marked, val_fraction=0)
    assert (
        f"data: preference pairs (chosen/rejected, the prompt their common beginning; chat messages, role/content) in {path}"
        in capsys.readouterr().out
    )
    assert pair_rows(found) == pair_rows(explicit) and len(pair_rows(found)) == 8
    model = lora(found.tokenizer, trained=True)
    theirs = dpo_losses(copy.deepcopy(model), explicit, 3)
    ours = dpo_losses(model, found, 3)
    assert ours == pytest.approx(theirs, abs=1e-6) and abs(ours[-1] - ours[0]) > 1e-3


@pytest.mark.parametrize(
    "chosen, rejected",
    [
        ("the sky is blue .", "the sky is green ."),
        ("the sky is blue .", "the sky is"),
        ("same", "same"),
        ("", "x"),
    ],
)
def test_an_implicit_text_prompt_is_trls(chosen, rejected):
    trl = pytest.importorskip("trl", reason="needs the bench extra: pip install -e '.[bench]'")
    if not chosen:
        return  # TRL's own ends at chosen[-1]; here an empty answer keeps an empty prompt
    assert implicit_prompt(chosen, rejected) == tuple(
        trl.extract_prompt({"chosen": chosen, "rejected": rejected}).values()
    )


def trl_rows(tokenizer, records, tmp_path):
    """TRL's tokens of each pair: prompt + answer, and which are the answer's."""
    trl = pytest.importorskip("trl", reason="needs the bench extra: pip install -e '.[bench]'")
    datasets = pytest.importorskip("datasets", reason="needs the hf extra: pip install -e '.[hf]'")
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, max_length=None)
    trainer = trl.DPOTrainer(
        model=tiny_llama(tokenizer), ref_model=tiny_llama(tokenizer, seed=1), args=args,
        train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer,
    )  # fmt: skip
    out = []
    for row in trainer.train_dataset:
        prompt = row["prompt_ids"]
        for side in ("chosen", "rejected"):
            out += [prompt + row[f"{side}_ids"], [-100] * len(prompt) + row[f"{side}_ids"]]
    return out


def our_rows(splits):
    return [
        row[f"{side}_{k}"]
        for row in pair_rows(splits)
        for side in ("chosen", "rejected")
        for k in ("input_ids", "labels")
    ]


def test_string_pairs_are_raw_text_as_trl_takes_them(tokenizers, tmp_path, capsys):
    """Issue 49: pairs of strings were wrapped in the chat template, default system prompt
    included; TRL trains on them as raw text: prompt + answer + EOS, no template."""
    records = [p for p in PAIRS if all(isinstance(v, str) for v in p.values())]
    path = write_pairs_jsonl(tmp_path / "text.jsonl", records)
    ours = hf_preference(str(path), tokenizer=tokenizers.chatml, val_fraction=0)
    assert "(prompt/chosen/rejected; plain text, no template)" in capsys.readouterr().out
    tok = ours.tokenizer
    assert our_rows(ours) == trl_rows(tok, records, tmp_path)
    assert tok.convert_tokens_to_ids("<|im_start|>") not in ours.train[0]["chosen_input_ids"]
    implicit_path = write_pairs_jsonl(
        tmp_path / "implicit.jsonl", [implicit({**p, "prompt": p["prompt"] + " "}) for p in records]
    )
    found = hf_preference(str(implicit_path), tokenizer=tokenizers.chatml, val_fraction=0)
    theirs = [implicit({**p, "prompt": p["prompt"] + " "}) for p in records]
    assert our_rows(found) == trl_rows(tok, theirs, tmp_path)


def test_chatml_pairs_take_trls_tokens_and_markers_cut_at_the_markers(tokenizers, tmp_path):
    """Issue 49 item 4: pairs were cut at the generation markers (ChatML's newline after
    <|im_end|> left out), where TRL takes the rendered prompt + answer after the rendered prompt;
    the marker cut stays as an option."""
    records = [as_messages(p) for p in PAIRS]
    path = str(write_pairs_jsonl(tmp_path / "pairs.jsonl", records))
    ours = hf_preference(path, tokenizer=tokenizers.chatml, val_fraction=0)
    newline = ours.tokenizer.convert_tokens_to_ids(NEWLINE)
    assert our_rows(ours) == trl_rows(ours.tokenizer, records, tmp_path)
    assert all(row["chosen_labels"][-1] == newline for row in pair_rows(ours))
    marked = hf_preference(path, tokenizer=tokenizers.chatml, val_fraction=0, completion_tokens="markers")
    for cut, whole in zip(pair_rows(marked), pair_rows(ours)):
        assert cut["chosen_input_ids"] == whole["chosen_input_ids"]
        assert cut["chosen_labels"] == whole["chosen_labels"][:-1] + [-100]
    with pytest.raises(ConfigError, match="data.dataset.completion_tokens=generation: rendered"):
        hf_preference(path, tokenizer=tokenizers.chatml, completion_tokens="generation")


def test_dpo_with_lora_on_chatml_with_markers_equals_trl_over_10_steps(tokenizers, tmp_path):
    """Issue 49's acceptance: the losses of 10 SGD steps of DPO with LoRA, on a ChatML template
    whose generation markers leave the newline after <|im_end|> out, are TRL's (1e-5)."""
    trl = pytest.importorskip("trl", reason="needs the bench extra: pip install -e '.[bench]'")
    datasets = pytest.importorskip("datasets", reason="needs the hf extra: pip install -e '.[hf]'")
    records = [as_messages(p) for p in PAIRS]
    ours = hf_preference(
        str(write_pairs_jsonl(tmp_path / "p.jsonl", records)), tokenizer=tokenizers.chatml, val_fraction=0
    )
    model = lora(ours.tokenizer)
    theirs_model = copy.deepcopy(model)
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"), beta=0.1, per_device_train_batch_size=8, max_steps=10, learning_rate=LR,
        optim="sgd", lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", max_length=None, bf16=False,  # TRL's default: bf16 autocast
    )  # fmt: skip
    trainer = trl.DPOTrainer(
        model=theirs_model,
        args=args,
        train_dataset=datasets.Dataset.from_list(records),
        processing_class=ours.tokenizer,
    )
    theirs, compute = [], trainer.compute_loss

    def recorded(*args, **kwargs):
        loss = compute(*args, **kwargs)
        theirs.append(float(loss.item() if not isinstance(loss, tuple) else loss[0].item()))
        return loss

    trainer.compute_loss = recorded
    trainer.train()
    assert len(theirs) == 10
    assert dpo_losses(model, ours, 10) == pytest.approx(theirs, abs=1e-5)
    assert theirs[-1] < theirs[0] - 1e-3  # it trained


def test_pairs_whose_answers_are_the_same_are_counted_and_dropped(tokenizers, tmp_path, capsys):
    """Issue 48 item 8: a pair whose chosen equals its rejected gives a zero gradient; a run of
    only such pairs was a no-op that exited 0 at ln 2."""
    same = [{**p, "rejected": p["chosen"]} for p in PAIRS[:3]]
    path = write_pairs_jsonl(tmp_path / "pairs.jsonl", [*PAIRS, *same])
    splits = hf_preference(str(path), tokenizer=tokenizers.marked, val_fraction=0)
    assert len(splits.train) == len(PAIRS)
    assert (
        "data: 3 of 11 pairs dropped: chosen and rejected are the same tokens (nothing to prefer); fix or remove them"
        in capsys.readouterr().out
    )
    only = write_pairs_jsonl(tmp_path / "only.jsonl", same)
    with pytest.raises(
        ConfigError, match="no pairs left to learn from: chosen and rejected are the same tokens"
    ):
        hf_preference(str(only), tokenizer=tokenizers.marked, val_fraction=0)
    streamed = hf_preference(str(path), tokenizer=tokenizers.marked, streaming=True, shards=1)
    from framework.data.streams import Reader

    assert len(list(Reader(streamed.train, 0, 1, 0, {}))) == len(PAIRS)
    assert (
        "data: 1 of 9 pairs read so far dropped: chosen and rejected are the same" in capsys.readouterr().out
    )


def test_a_row_without_an_answer_is_one_line(tokenizers, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps({"prompt": "hi", "chosen": "x"}) + "\n")
    with pytest.raises(
        ConfigError, match=rf"^{path} line 2: no 'rejected' in the row \(it has \['chosen', 'prompt'\]\)"
    ):
        hf_preference(str(path), tokenizer=tokenizers.marked, val_fraction=0)
