"""Run under torchrun (or alone): SFT through `Engine.fit` with its loss chunked (the default: the
output head applied to the labelled positions in chunks, the logits never held) must give the
weights of plain PyTorch on one process computing the loss from the model's full logits (fp32),
and log its loss at every step. The weights after the first SGD step are the gradient's witness
(their error over the learning rate is the gradient's, plus a rounding of the weights); after
the last, the trajectory's.

Cases: a tiny Llama trained whole (its head untied, and tied to the embedding), with LoRA on
every linear layer but the head, with LoRA on the head too, and the framework's GPT (its head
the token embedding), under ZeRO-3 and ZeRO-0 with accumulation 1 and 2; and the logits path
(`chunked_loss=False`) beside them. Chunks of 5 positions: every micro-batch is several chunks.

Usage: chunked_invariance.py OUT_DIR. Writes OUT_DIR/rank<R>.json: {"errors": {case: [max weight
error after the first step / lr, max loss error, max weight error after the last step]},
"head_calls": {case: [calls of the head module, of them those that gave logits]}} (the GPT's head
is its embedding: two calls a micro-batch; under ZeRO-3 each call of the head is one gathering of
its weights for all the chunks of a micro-batch, and one for their backward pass).
"""

import functools
import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from framework import Callback, Engine, ProcessContext, Strategy
from framework.methods import SFT
from framework.methods.tokens import answer_stats
from framework.models import GPT
from tests.helpers.tiny_chat import random_lora

out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
GLOBAL, STEPS, T, V, LR, CHUNK = 4, 2, 16, 96, 0.5, 5
torch.manual_seed(0)
tokens = torch.randint(0, V, (GLOBAL * STEPS, T))
labels = tokens.clone()
for i in range(len(tokens)):  # row i: a prompt of 2 + i % 3 tokens, then an answer of 4 + i tokens
    labels[i, : 2 + i % 3] = -100
    labels[i, 6 + i :] = -100
mask = torch.ones_like(tokens)
data = [{"input_ids": tokens[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(len(tokens))]
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama(tied=False):
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def adapted(model, on_head):
    """LoRA (r=4) with random B matrices, so the adapters change the loss from the first step."""
    targets = [*LINEAR, "lm_head"] if on_head else LINEAR
    return random_lora(model, r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)


def gpt():
    torch.manual_seed(0)
    return GPT(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=32)


MODELS = {
    "full": lambda: llama(),
    "tied": lambda: llama(tied=True),
    "lora": lambda: adapted(llama(), on_head=False),
    "lora_head": lambda: adapted(llama(), on_head=True),
    "gpt": gpt,  # the framework's own: its head tied to the embedding
}


def rows_of(kind, rows):
    """The model's inputs of `rows` (the GPT takes token ids as `idx`)."""
    if kind == "gpt":
        return {"idx": tokens[rows]}
    return {"input_ids": tokens[rows], "attention_mask": mask[rows], "use_cache": False}


def reference(kind):
    """Plain PyTorch on one process, from the full logits: (weights after each step, losses)."""
    model = MODELS[kind]()
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=LR)
    weights, losses = [], []
    for s in range(STEPS):
        rows = slice(s * GLOBAL, (s + 1) * GLOBAL)
        outputs = model(**rows_of(kind, rows))
        stats = answer_stats(getattr(outputs, "logits", outputs), labels[rows])
        loss = -stats.logps.sum() / stats.tokens.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return weights, losses


class Logged(Callback):
    """The loss of every step (log_freq=1) and the trained weights after it."""

    def __init__(self):
        self.losses, self.weights = [], []
        self.engine = None

    def on_step_end(self, state):
        if "loss" in state.logs:
            self.losses.append(state.logs["loss"])
            self.weights.append(self.engine.runtime.full_state_dict(on_every_rank=True))


def train(kind, stage, acc, chunked=True):
    model = MODELS[kind]()
    head = model.output_head() if kind == "gpt" else model.get_output_embeddings()
    calls = []
    # logits are [rows, positions, V]; the chunks give [4, positions] (the GPT's embedding: [.., .., 32])
    head.register_forward_hook(lambda _m, _i, out: calls.append(out.dim() == 3 and out.shape[-1] == V))
    engine = Engine(
        model,
        optimizer=functools.partial(torch.optim.SGD, lr=LR),
        strategy=Strategy(sharding={"stage": stage}, gradient_merge={"k_steps": acc}),
        process=job,
        train_step=SFT(chunked_loss=chunked, chunk_size=CHUNK),
    )
    logged = Logged()
    logged.engine = engine
    rows = [{"idx": r["input_ids"], "labels": r["labels"]} for r in data] if kind == "gpt" else data
    engine.fit(
        rows, batch_size=GLOBAL, epochs=1, shuffle=False, log_freq=1, callbacks=[logged], progress=False
    )
    want_weights, want_losses = references[kind]
    assert len(logged.weights) == STEPS and len(logged.losses) == STEPS, (
        len(logged.weights),
        len(logged.losses),
    )
    first, last = (
        max((got[k].float() - v).abs().max().item() for k, v in want.items())
        for got, want in ((logged.weights[0], want_weights[0]), (logged.weights[-1], want_weights[-1]))
    )
    case = f"{kind} zero{stage} acc{acc}" + ("" if chunked else " logits")
    errors[case] = [first / LR, max(abs(a - b) for a, b in zip(logged.losses, want_losses)), last]
    head_calls[case] = [len(calls), sum(calls)]
    engine.close()


job = ProcessContext.start(timeout_s=120)
references = {kind: reference(kind) for kind in MODELS}
errors, head_calls = {}, {}
for kind in MODELS:
    train(kind, 3, 1 if kind in ("full", "lora") else 2)
train("full", 0, 2)
train("lora_head", 0, 1)
train("full", 3, 1, chunked=False)
rank = job.rank
job.close()
(out_dir / f"rank{rank}.json").write_text(json.dumps({"errors": errors, "head_calls": head_calls}))
