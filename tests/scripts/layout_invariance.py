"""Run under torchrun (or alone): one optimizer step of the same global batch of padded token
sequences, through `Engine.fit` and through the fine-grained `run`, for every ZeRO stage x
accumulation steps, must give the weights of plain torch on the whole batch (the loss summed
over counted tokens / their number), and log that loss. Models: the framework's GPT with
`loss=lm`, and a tiny Hugging Face Llama with `loss=model`.

Usage: layout_invariance.py OUT_DIR [MODELS] [PARALLEL] [STAGES] [ACCUMULATIONS] [PATHS], e.g.
`out gpt,llama tp2 0,3 1,2 fit`: PARALLEL is `dp` (the default), `tp<N>` or `sp<N>` (that
degree of tensor or sequence parallelism; the rest of the ranks data-parallel).

Every step clips the gradient norm at half the reference's, so the global norm each layout
computes is checked too (and `run` fetches it).

Writes OUT_DIR/rank<R>.json: {"errors": {"<model> <parallel> <path> zero<S> acc<A>": [max weight
error, loss error, grad-norm error]}, "shares": {case: this rank's parameter elements / the whole model's},
"lengths": {case: the sequence lengths the model was given in training on this rank}}. PATHS may
also name `predict` ("<model> <parallel> predict": [max logit error, sample count error]) and
`evaluate` ("<model> <parallel> evaluate": [loss error]; the whole batch's token mean only with
one data-parallel replica: evaluation averages its batches' token means).
"""

import copy
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from framework import Callback, Engine, Strategy, device
from framework.models import GPT, LMLoss


def arg(i, default):
    return sys.argv[i] if len(sys.argv) > i else default


out_dir, which, parallel = Path(sys.argv[1]), arg(2, "gpt,llama"), arg(3, "dp")
out_dir.mkdir(parents=True, exist_ok=True)
stages = [int(x) for x in arg(4, "0,1,2,3").split(",")]
accumulations = [int(x) for x in arg(5, "1,2,4").split(",")]
paths = arg(6, "fit,run").split(",")
degrees = {}
if parallel.startswith("tp"):
    degrees["tensor_parallel"] = {"degree": int(parallel[2:])}
elif parallel.startswith("sp"):
    degrees["sequence_parallel"] = {"degree": int(parallel[2:])}
GLOBAL, T, V, LR = 8, 16, 64, 0.5
torch.manual_seed(0)
tokens = torch.randint(0, V, (GLOBAL, T))
labels = tokens.clone()
for i in range(GLOBAL):  # sample i counts 2 + 2*i tokens (padding is -100): 2 ... 16
    labels[i, 2 + 2 * i :] = -100
mask = (labels != -100).long()
mask[:, 0] = 1


def gpt_case():
    model = GPT(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=32)

    def reference_loss(m):
        logits = m(tokens)
        return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)

    data = list(zip(tokens, labels))
    return model, LMLoss(), reference_loss, data


def llama_case():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=T,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)

    def reference_loss(m):
        return m(input_ids=tokens, attention_mask=mask, labels=labels, use_cache=False).loss

    data = [{"input_ids": tokens[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(GLOBAL)]
    return model, "model", reference_loss, data


class FirstLoss(Callback):
    """The loss logged at the first optimizer step (log_freq=1: reduced over ranks)."""

    loss = None

    def on_step_end(self, state):
        if "loss" in state.logs and self.loss is None:
            self.loss = state.logs["loss"]


def recorder(seen):
    """A forward pre-hook noting the length of the token sequences a model is given in training."""

    def record(module, args, kwargs):
        if module.training:
            seen.add((kwargs["input_ids"] if "input_ids" in kwargs else args[0]).shape[-1])

    return record


device.init_process_group(timeout_s=120)  # one group for every engine below
rank, world = device.rank(), device.world_size()
errors, shares, lengths = {}, {}, {}  # shares: this rank's parameter elements / the model's
for name in which.split(","):
    model, loss, reference_loss, data = {"gpt": gpt_case, "llama": llama_case}[name]()
    reference = copy.deepcopy(model)
    ref_loss = reference_loss(reference)
    ref_loss.backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    clip = ref_norm / 2  # the step clips: the norm every layout computes must be the global one
    torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
    torch.optim.SGD(reference.parameters(), lr=LR).step()
    expected = reference.state_dict()
    if "predict" in paths:  # the outputs in dataset order, each sample once, under every degree
        engine = Engine(copy.deepcopy(model), loss, strategy=Strategy(**degrees))
        outputs = engine.predict(data, batch_size=GLOBAL // 2)
        got = torch.cat([getattr(o, "logits", o) for o in outputs])
        with torch.no_grad():
            want = model(tokens) if name == "gpt" else model(input_ids=tokens, attention_mask=mask).logits
        errors[f"{name} {parallel} predict"] = [(got - want).abs().max().item(), abs(len(got) - len(want))]
    if "evaluate" in paths:  # the loss of whole sequences, under every degree
        engine = Engine(copy.deepcopy(model), loss, strategy=Strategy(**degrees))
        with torch.no_grad():
            want = reference_loss(copy.deepcopy(model)).item()
        errors[f"{name} {parallel} evaluate"] = [abs(engine.evaluate(data, batch_size=GLOBAL)["loss"] - want)]
    for stage in stages:
        for acc in accumulations:
            for path in (p for p in paths if p in ("fit", "run")):
                engine = Engine(
                    copy.deepcopy(model), loss, functools.partial(torch.optim.SGD, lr=LR),
                    strategy=Strategy(
                        sharding={"stage": stage}, gradient_merge={"k_steps": acc},
                        gradient_clip={"max_norm": clip}, **degrees,
                    ),
                )  # fmt: skip
                seen = set()
                engine.module.register_forward_pre_hook(recorder(seen), with_kwargs=True)
                if path == "fit":
                    first = FirstLoss()
                    engine.fit(
                        data, batch_size=GLOBAL, epochs=1, shuffle=False, log_freq=1, callbacks=[first]
                    )
                    logged, norm = first.loss, ref_norm
                else:
                    loader = engine.dataloader(data, batch_size=GLOBAL, mode="train")
                    logs = engine.run(next(iter(loader)), fetch_list=["grad_norm"])
                    logged, norm = device.all_reduce_mean(logs["loss"]), logs["fetches"]["grad_norm"]
                local = sum(p.numel() for p in engine.module.parameters() if p.numel())
                state = engine.runtime.full_state_dict(on_every_rank=True)
                shares[f"{name} {parallel} {path} zero{stage} acc{acc}"] = local / sum(
                    v.numel() for k, v in state.items() if k in dict(engine.module.named_parameters())
                )
                lengths[f"{name} {parallel} {path} zero{stage} acc{acc}"] = sorted(seen)
                weight_error = max((state[k].float() - v).abs().max().item() for k, v in expected.items())
                errors[f"{name} {parallel} {path} zero{stage} acc{acc}"] = [
                    weight_error,
                    abs(logged - ref_loss.item()),
                    abs(norm - ref_norm),  # run: the fetched grad_norm (fit logs none)
                ]
device.destroy_process_group()
(out_dir / f"rank{rank}.json").write_text(
    json.dumps({"errors": errors, "shares": shares, "lengths": lengths})
)
