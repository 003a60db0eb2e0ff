"""Run under torchrun (or alone): LoRA training of a tiny Llama through `Engine.fit` under every
ZeRO stage x accumulation steps must give, after several SGD steps, the weights of a plain
PyTorch + PEFT loop on one process over the same global batches (fp32), and log its loss and
grad_norm at every step. Only the adapter's parameters reach the optimizer; the frozen base is
unchanged. Also: a model the user wrapped with `peft.get_peft_model` (ZeRO-3), `modules_to_save`
under ZeRO-3 (the head trained whole beside the adapters), recompute with a frozen base (ZeRO-3).

Usage: lora_invariance.py OUT_DIR [STAGES] [ACCUMULATIONS] [EXTRAS]   (EXTRAS: wrapped,save,recompute)

Writes OUT_DIR/rank<R>.json: {"errors": {case: [max weight error, max loss error, max grad-norm
error, max error of the logged counted_items (the tokens each step's loss counts)]}, "optimizer": {case: [parameter elements the optimizer holds, all ranks, trainable elements]},
"lora_b": {case: max |lora_B|}, "frozen_share": {case: this rank's elements of the frozen base / the
base's}}; checkpoints OUT_DIR/ckpt-zero0 and ckpt-zero3 (of the cases
zero0 acc1, zero3 acc2) and the base model's save_pretrained directory OUT_DIR/base.
"""

import copy
import functools
import json
import sys
from pathlib import Path

import peft
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from framework import Callback, Engine, ProcessContext, Strategy

out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
stages = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "0,1,2,3").split(",")]
accumulations = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "1,2").split(",")]
extras = (sys.argv[4] if len(sys.argv) > 4 else "wrapped,save,recompute").split(",")
GLOBAL, STEPS, T, V, LR = 4, 3, 16, 64, 0.5
torch.manual_seed(0)
tokens = torch.randint(0, V, (GLOBAL * STEPS, T))
labels = tokens.clone()
for i in range(len(tokens)):  # sample i counts 3 + i tokens (padding is -100)
    labels[i, 3 + i :] = -100
mask = (labels != -100).long()
mask[:, 0] = 1
data = [{"input_ids": tokens[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(len(tokens))]
config = LlamaConfig(
    vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=T,
)  # fmt: skip
base = LlamaForCausalLM(config)


def lora(modules_to_save=None):
    return peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", modules_to_save=modules_to_save,
        init_lora_weights=True, task_type="CAUSAL_LM",
    )  # fmt: skip


def reference(adapter):
    """Plain PyTorch + PEFT on one process: (state dict after STEPS steps, losses, grad norms)."""
    torch.manual_seed(1)  # the adapters' initialisation
    model = peft.get_peft_model(copy.deepcopy(base), adapter)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, norms = [], []
    for s in range(STEPS):
        rows = slice(s * GLOBAL, (s + 1) * GLOBAL)
        loss = model(
            input_ids=tokens[rows], attention_mask=mask[rows], labels=labels[rows], use_cache=False
        ).loss
        loss.backward()
        trained = [p.grad for p in model.parameters() if p.grad is not None]
        norms.append(torch.nn.utils.get_total_norm(trained).item())
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


class Logged(Callback):
    """Loss and grad_norm of every logged step (log_freq=1)."""

    def __init__(self):
        self.losses, self.norms, self.counted = [], [], []

    def on_step_end(self, state):
        if "loss" in state.logs:
            self.losses.append(state.logs["loss"])
            self.norms.append(state.logs.get("grad_norm", float("nan")))
            self.counted.append(state.logs.get("counted_items", float("nan")))


def optimizer_elements(engine, job):
    """Parameter elements DeepSpeed's optimizer holds, summed over the data-parallel ranks (ZeRO
    1-3 partition them; ZeRO-0 holds them whole on every rank: counted once)."""
    held = sum(
        getattr(p, "ds_tensor", p).numel() for g in engine.runtime.optimizer.param_groups for p in g["params"]
    )
    total = job.all_reduce_mean(float(held)) * job.world_size
    return total / job.world_size if engine.runtime.strategy.sharding.stage == 0 else total


def train(case, stage, acc, adapter, wrapped=False, **strategy):
    torch.manual_seed(1)
    model = copy.deepcopy(base)
    if wrapped:  # the user wraps the model themselves
        model, adapter = peft.get_peft_model(model, adapter), None
    engine = Engine(
        model, "model", functools.partial(torch.optim.SGD, lr=LR),
        strategy=Strategy(sharding={"stage": stage}, gradient_merge={"k_steps": acc}, **strategy),
        process=job, adapter=adapter,
    )  # fmt: skip
    logged = Logged()
    engine.fit(data, batch_size=GLOBAL, epochs=1, shuffle=False, log_freq=1, callbacks=[logged])
    state = engine.runtime.full_state_dict(on_every_rank=True)
    want, losses, norms = references[id(adapter) if adapter is not None else "wrapped"]
    errors[case] = [
        max((state[k].float() - v).abs().max().item() for k, v in want.items()),
        max(abs(a - b) for a, b in zip(logged.losses, losses)) if len(logged.losses) == STEPS else 1.0,
        max(abs(a - b) for a, b in zip(logged.norms, norms)) if len(logged.norms) == STEPS else 1.0,
        max(abs(a - b) for a, b in zip(logged.counted, counted)),  # the tokens each step's loss counted
    ]
    trainable = sum(
        int(getattr(p, "ds_numel", p.numel())) for p in engine.module.parameters() if p.requires_grad
    )
    optimizer[case] = [optimizer_elements(engine, job), trainable]
    frozen = [p for p in engine.module.parameters() if not p.requires_grad]
    held = sum(getattr(p, "ds_tensor", p).numel() for p in frozen)  # ZeRO-3: this rank's partition
    shares[case] = held / sum(int(getattr(p, "ds_numel", p.numel())) for p in frozen)
    lora_b[case] = max(v.abs().max().item() for k, v in state.items() if "lora_B" in k)
    if case in ("zero0 acc1", "zero3 acc2"):  # for export --adapter / --hf (tests/integrations/test_peft.py)
        engine.save(str(out_dir / f"ckpt-zero{stage}"))


counted = [(labels[s * GLOBAL : (s + 1) * GLOBAL, 1:] != -100).sum().item() for s in range(STEPS)]
job = ProcessContext.start(timeout_s=120)
if job.is_main:
    base.save_pretrained(out_dir / "base")  # the base the adapters are trained on
errors, optimizer, lora_b, shares = {}, {}, {}, {}
plain, saving = lora(), lora(modules_to_save=["lm_head"])
references = {id(plain): reference(plain), id(saving): reference(saving), "wrapped": reference(plain)}
for stage in stages:
    for acc in accumulations:
        train(f"zero{stage} acc{acc}", stage, acc, plain)
if "wrapped" in extras:
    train("wrapped zero3 acc1", 3, 1, copy.deepcopy(plain), wrapped=True)
if "save" in extras:
    train("modules_to_save zero3 acc2", 3, 2, saving)
if "recompute" in extras:
    train("recompute zero3 acc2", 3, 2, plain, recompute={"enable": True})
rank = job.rank
job.close()
(out_dir / f"rank{rank}.json").write_text(
    json.dumps({"errors": errors, "optimizer": optimizer, "lora_b": lora_b, "frozen_share": shares})
)
