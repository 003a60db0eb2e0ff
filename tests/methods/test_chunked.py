"""The chunked head (`framework.methods.chunked`): the loss and every gradient equal the logits
path's (1e-6, fp32) for a tiny Llama trained whole (head untied and tied), with LoRA, with LoRA
on the head (dropout included), with a `modules_to_save` head, and for the framework's GPT;
entropy and the logged extras too; the batch's logits are never held; models and heads it does
not know are scored from their logits; and on 2 ranks, ZeRO-3 and ZeRO-0 train what plain torch
trains from the full logits."""

from __future__ import annotations

import copy

import pytest
import torch

from framework.errors import ConfigError
from framework.methods import DPO, GRPO, ORPO, SFT, SimPO
from framework.methods.chunked import fused_scores
from framework.methods.rollout import completion_mask, laid_out, token_logps
from framework.methods.tokens import answer_stats, score_answers
from framework.models import GPT
from tests.conftest import run_layout_script
from tests.helpers.tiny_chat import random_lora

peft = pytest.importorskip("peft", reason="needs the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

V, T, ROWS = 97, 12, 3
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama(tied=False, vocab=V):
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def lora(targets, dropout=0.0, **extra):
    """A tiny Llama with LoRA on `targets`, its B matrices random (the adapters count from the start)."""
    return random_lora(llama(), r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, **extra)


MODELS = {
    "full": lambda: llama(),
    "tied": lambda: llama(tied=True),
    "lora": lambda: lora(LINEAR),
    "lora on the head": lambda: lora([*LINEAR, "lm_head"]),
    "lora on the head, dropout": lambda: lora(["q_proj", "lm_head"], dropout=0.3),
    "modules_to_save head": lambda: lora(["q_proj"], modules_to_save=["lm_head"]),
}


@pytest.fixture(scope="module")
def rows():
    """Three rows: a prompt that does not count, an answer that does, padding after one."""
    torch.manual_seed(2)
    ids = torch.randint(0, V, (ROWS, T))
    labels = ids.clone()
    labels[0, :4] = -100
    labels[2, 7:] = -100
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask, "use_cache": False}, labels


def _run(model, inputs, labels, chunked, entropy=False):
    """(loss, per-row log p, mean logits, correct) of a loss over the answers (with an entropy
    term), and the gradient of every trained parameter; the same dropout masks either way."""
    model.zero_grad()
    torch.manual_seed(3)
    if chunked:
        scored = fused_scores(model, inputs, labels, chunk_size=5, entropy=entropy)
        assert scored is not None
        logps, extras = scored.logps.sum(-1), (scored.mean_logits.sum(-1), scored.correct.sum(-1))
        spread = scored.entropy
    else:
        logits = model(**inputs).logits
        stats = answer_stats(logits, labels, extras=True)
        logps, extras = stats.logps, (stats.mean_logits, stats.correct)
        log_p = torch.log_softmax(logits[:, :-1].float(), -1)
        spread = -(log_p.exp() * log_p).sum(-1) * (labels[:, 1:] != -100)
    loss = (-logps.sum() + (0.3 * spread.sum() if entropy else 0.0)) / 20  # means over ~20 tokens
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), logps.detach(), extras, grads


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("entropy", [False, True], ids=["nll", "nll+entropy"])
def test_the_loss_and_every_gradient_equal_the_logits_paths(rows, kind, entropy):
    inputs, labels = rows
    model = MODELS[kind]()
    model.train()
    full, chunked = _run(model, inputs, labels, False, entropy), _run(model, inputs, labels, True, entropy)
    assert (full[0] - chunked[0]).abs().item() <= 1e-6 * max(1.0, full[0].abs().item())
    assert (full[1] - chunked[1]).abs().max().item() <= 1e-6 * max(1.0, full[1].abs().max().item())
    assert (full[2][0] - chunked[2][0]).abs().max().item() <= 1e-5  # a sum of mean logits
    assert torch.equal(full[2][1], chunked[2][1])  # labels ranked first
    assert full[3].keys() == chunked[3].keys() and full[3]
    for name, grad in full[3].items():
        assert (grad - chunked[3][name]).abs().max().item() <= 1e-6, name


def test_the_framework_gpt_and_its_tied_head(rows):
    _, labels = rows
    ids = rows[0]["input_ids"]
    torch.manual_seed(0)
    model = GPT(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=16)
    results = []
    for chunked in (False, True):
        model.zero_grad()
        logps = score_answers(model, {"idx": ids}, labels, 4 if chunked else None).logps
        logps.sum().backward()
        results.append((logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (full, full_grads), (ours, our_grads) = results
    assert (full - ours).abs().max().item() <= 1e-6
    for name, grad in full_grads.items():
        scale = max(1.0, grad.abs().max().item())
        assert (grad - our_grads[name]).abs().max().item() <= 1e-6 * scale, name


class _Largest(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor any operation makes inside the block (elements)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_batch_logits_are_never_held():
    """Forward and backward of SFT's loss at a vocabulary of 4096: no tensor near the batch's
    [rows, positions, vocabulary] logits, the largest a chunk's logits or a weight's gradient
    ([vocabulary, hidden]); the logits path makes them."""
    vocab, rows, positions, chunk = 4096, 4, 48, 16
    model = llama(vocab=vocab)
    ids = torch.randint(0, vocab, (rows, positions))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    sizes = []
    for chunk_size in (chunk, None):
        with _Largest() as seen:
            score_answers(model, inputs, ids, chunk_size).logps.sum().backward()
        sizes.append(seen.largest)
    hidden = model.config.hidden_size
    assert sizes[0] <= max(chunk, hidden) * vocab < rows * positions * vocab <= sizes[1]


def test_methods_score_through_the_chunks_by_default_and_from_the_logits_when_told(rows):
    """SFT's loss and mean_token_accuracy are the same either way; only chunked_loss=False makes
    the head give logits."""
    inputs, labels = rows
    model = llama()
    logits_calls = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: logits_calls.append(out.dim() == 3))
    host = type("Host", (), {"model": model, "module": model, "output_key": None, "label_key": "labels"})()
    batch = {**{k: v for k, v in inputs.items() if k != "use_cache"}, "labels": labels}
    results = []
    for options in ({}, {"chunked_loss": False}):
        sft = SFT(**options)
        results.append((sft(host, batch).item(), sft.step_logs()["mean_token_accuracy"], any(logits_calls)))
        logits_calls.clear()
    (chunked, accuracy, logits), (full, full_accuracy, full_logits) = results
    assert chunked == pytest.approx(full, abs=1e-6) and accuracy == full_accuracy
    assert not logits and full_logits
    for method in (SFT, DPO, SimPO, ORPO, GRPO):
        assert method.Config().chunked_loss and method.Config().chunk_size == 1024
    with pytest.raises(ConfigError, match=r"SFT\(chunk_size=0\): must be >= 1"):
        SFT(chunk_size=0)


def test_the_model_forward_is_its_own_after_a_chunked_call_even_one_that_failed(rows):
    """The chunked call stands in for the model's forward for that call only: after it, and after
    one that raised, the model gives its logits as before."""
    inputs, labels = rows
    model = llama()
    fused_scores(model, inputs, labels, 5)
    assert model(**inputs).logits.shape == (ROWS, T, V) and "forward" not in vars(model)
    with pytest.raises(IndexError):
        fused_scores(model, inputs, labels[:, :3], 5)  # labels that do not fit the rows
    assert model(**inputs).logits.shape == (ROWS, T, V) and "forward" not in vars(model)


def test_grpo_token_logps_and_entropy_equal_the_logits_paths():
    """Per completion token through the completion's end; zero after it (the loss masks it)."""
    model = llama()
    prompt = torch.tensor([[0, 2, 10], [2, 12, 13], [5, 2, 10]])
    completions = torch.tensor([[14, 15, 3], [16, 3, 0], [17, 18, 19]])
    mask, _ = completion_mask(completions, {3})
    batch = laid_out(prompt, (prompt != 0).long(), completions, mask)
    grads = []
    for chunk_size in (None, 2):
        model.zero_grad()
        logps, entropy = token_logps(model, batch, entropy=True, chunk_size=chunk_size)
        ((logps + 0.1 * entropy) * mask).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if chunk_size is None:
            full = (logps.detach() * mask, entropy.detach() * mask)
    assert (logps.detach() - full[0]).abs().max().item() <= 1e-6
    assert (entropy.detach() - full[1]).abs().max().item() <= 1e-6
    assert all((a - b).abs().max().item() <= 1e-6 for a, b in zip(*grads))


def _dora_head():
    return lora(["q_proj", "lm_head"], use_dora=True)


def _wrapped_forward():
    model = llama()
    model.forward = model.forward  # a forward replaced on the instance (as accelerate's hooks do)
    return model


def _softcapped():
    config = transformers.Gemma2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    return transformers.Gemma2ForCausalLM(config)


@pytest.mark.parametrize("make", [_dora_head, _wrapped_forward, _softcapped], ids=lambda f: f.__name__)
def test_what_the_chunks_do_not_know_is_scored_from_its_logits(rows, make):
    """DoRA on the head, a forward replaced on the instance, logits soft-capped after the head:
    no chunked path, and `score_answers` gives the logits path's numbers."""
    inputs, labels = rows
    model = make()
    assert fused_scores(model, inputs, labels, 5) is None
    with torch.no_grad():
        want = answer_stats(model(**inputs).logits, labels).logps
        assert torch.equal(score_answers(model, inputs, labels, 5).logps, want)
        assert torch.equal(score_answers(model, inputs, labels, 5, output_key="logits").logps, want)


def test_a_reference_with_adapters_off_is_the_base_model_chunked_too(rows):
    """A LoRA head switched off (DPO's reference) scores as the base model does."""
    inputs, labels = rows
    model = lora([*LINEAR, "lm_head"])
    base = copy.deepcopy(model.get_base_model())
    with torch.no_grad(), model.disable_adapter():
        off = fused_scores(model, inputs, labels, 5).logps.sum(-1)
    for module in base.modules():  # the base alone: every LoRA layer as its base layer
        for name, child in list(module.named_children()):
            if hasattr(child, "base_layer"):
                setattr(module, name, child.base_layer)
    with torch.no_grad():
        want = answer_stats(base(**inputs).logits, labels).logps
    assert (off - want).abs().max().item() <= 1e-6


# ------------------------------------------------------------------------------------- 2 ranks


@pytest.mark.slow
def test_zero3_on_two_ranks_trains_what_plain_torch_trains_from_the_logits(tmp_path):
    """tests/scripts/chunked_invariance.py on 2 ranks: SFT chunked (5 positions a chunk) under
    ZeRO-3 (accumulation 1 and 2) and ZeRO-0 gives plain torch's gradients (the weights after
    the first SGD step over the learning rate: 1e-6), its losses at every step (1e-6) and its
    weights after the last (1e-5), for a
    Llama trained whole (head untied, tied), with LoRA and with LoRA on the head, and the
    framework's GPT. The head module
    is called once per micro-batch (ZeRO-3 gathers its weights in that call's hooks: once for
    all the chunks, once for their backward pass) and never gives logits; with
    chunked_loss=False it does."""
    results = run_layout_script(tmp_path, script="chunked_invariance.py", timeout=400)
    for result in results:
        assert len(result["errors"]) == 8
        bad = {case: e for case, e in result["errors"].items() if max(e[:2]) > 1e-6 or e[2] > 1e-5}
        assert not bad, bad
        for case, (calls, logits) in result["head_calls"].items():
            micro_batches = 2 * int(case.split("acc")[1][0])  # 2 steps
            per_batch = 2 if case.startswith("gpt") else 1  # the GPT's head is its embedding too
            assert calls == per_batch * micro_batches, case
            assert logits == (calls if "logits" in case else 0), case
