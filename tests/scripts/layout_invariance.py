"""Run under torchrun (or alone): one optimizer step of the same global batch of padded token
sequences, through `Engine.fit` and through the fine-grained `run`, for every ZeRO stage x
accumulation steps, must give the weights of plain torch on the whole batch (the loss summed
over counted tokens / their number), and log that loss. Models: the framework's GPT with
`loss=lm`, and tiny Hugging Face Llama, Mixtral and DeepSeek-V3 (4 experts, top 2) models with
`loss=model`.

Usage: layout_invariance.py OUT_DIR [MODELS] [PARALLEL] [STAGES] [ACCUMULATIONS] [PATHS], e.g.
`out gpt,llama tp2 0,3 1,2 fit`: PARALLEL is `dp` (the default), `tp<N>` or `sp<N>` (that
degree of tensor or sequence parallelism; the rest of the ranks data-parallel), `ep<N>` (the
experts split over N data-parallel ranks: models `mixtral`, `deepseek`), or several (`tp2ep2`).
PATHS: `fit`, `run`, and `export` (a `run` whose weights are taken as `Engine.save(training=False)`
writes them and a fresh model loads them: `from_pretrained` for a Hugging Face model).

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
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from framework import Callback, Engine, ProcessContext, Strategy
from framework.models import GPT, LMLoss


def arg(i, default):
    return sys.argv[i] if len(sys.argv) > i else default


out_dir, which, parallel = Path(sys.argv[1]), arg(2, "gpt,llama"), arg(3, "dp")
out_dir.mkdir(parents=True, exist_ok=True)
stages = [int(x) for x in arg(4, "0,1,2,3").split(",")]
accumulations = [int(x) for x in arg(5, "1,2,4").split(",")]
paths = arg(6, "fit,run").split(",")
SECTIONS = {"tp": "tensor_parallel", "sp": "sequence_parallel", "ep": "expert_parallel"}
degrees = {SECTIONS[kind]: {"degree": int(n)} for kind, n in re.findall(r"(tp|sp|ep)(\d+)", parallel)}
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


def mlp_case():
    """A user's own model with no plan of its own: the strategy's `tensor_parallel.plan` says which
    linears split (a column / row pair, as a Megatron MLP), the class labels weigh by samples."""
    from framework.models import MLP

    features, classes = torch.randn(GLOBAL, 16), torch.randint(0, 4, (GLOBAL,))
    model = MLP(in_features=16, hidden=(32, 32), num_classes=4)
    plan = {"features.0": "column", "features.2": "row"}

    def reference_loss(m):
        return F.cross_entropy(m(features), classes)

    return model, torch.nn.CrossEntropyLoss(), reference_loss, list(zip(features, classes)), plan


def hf_case(model):
    """A Hugging Face causal LM with `loss=model`: batches are dicts, the model computes the loss."""

    def reference_loss(m):
        return m(input_ids=tokens, attention_mask=mask, labels=labels, use_cache=False).loss

    data = [{"input_ids": tokens[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(GLOBAL)]
    return model, "model", reference_loss, data


def llama_case():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=T,
    )  # fmt: skip
    return hf_case(LlamaForCausalLM(cfg))


def mixtral_case():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=T, num_local_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.0,
    )  # fmt: skip
    return hf_case(MixtralForCausalLM(cfg))


def deepseek_case():
    """DeepSeek-V3's MoE: a dense first layer, a shared expert, a router with a score bias."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=T,
    )  # fmt: skip
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # a bias that changes which experts are chosen (it starts at zero)
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return hf_case(model)


def exported(engine, model, out):
    """The weights `Engine.save(training=False)` writes, as a fresh model loads them: a Hugging
    Face model's `save_pretrained` directory through `from_pretrained`, else a safetensors file
    through `load_state_dict(strict=True)`."""
    from framework.backend.weights import load_weights

    hf = hasattr(model, "save_pretrained")
    written = engine.save(str(out if hf else out.with_suffix(".safetensors")), training=False)
    if hf:
        return type(model).from_pretrained(written).state_dict()
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(load_weights(written), strict=True)
    return fresh.state_dict()


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


job = ProcessContext.start(timeout_s=120)  # one group for every engine below
rank, world = job.rank, job.world_size
errors, shares, lengths = {}, {}, {}  # shares: this rank's parameter elements / the model's
CASES = {
    "gpt": gpt_case,
    "llama": llama_case,
    "mixtral": mixtral_case,
    "deepseek": deepseek_case,
    "mlp": mlp_case,
}
strategy_degrees = degrees
for name in which.split(","):
    model, loss, reference_loss, data, *plan = CASES[name]()
    degrees = copy.deepcopy(strategy_degrees)
    if plan and "tensor_parallel" in degrees:
        degrees["tensor_parallel"]["plan"] = plan[0]
    reference, unclipped = copy.deepcopy(model), copy.deepcopy(model)
    ref_loss = reference_loss(reference)
    ref_loss.backward()
    reference_loss(unclipped).backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    clip = ref_norm / 2  # the step clips: the norm every layout computes must be the global one
    torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
    torch.optim.SGD(reference.parameters(), lr=LR).step()
    torch.optim.SGD(unclipped.parameters(), lr=LR).step()
    expected = reference.state_dict()
    # DeepSpeed's ZeRO-0 clips wrongly under expert parallelism (refused by the framework): there
    # the step does not clip, and `run` still checks the grad_norm it fetches
    no_clip = {0: 0.0} if "expert_parallel" in degrees else {}
    if "predict" in paths:  # the outputs in dataset order, each sample once, under every degree
        engine = Engine(copy.deepcopy(model), loss, strategy=Strategy(**degrees), process=job)
        outputs = engine.predict(data, batch_size=GLOBAL // 2)
        got = torch.cat([getattr(o, "logits", o) for o in outputs])
        with torch.no_grad():
            if name in ("gpt", "mlp"):
                want = model(tokens if name == "gpt" else torch.stack([x for x, _ in data]))
            else:
                want = model(input_ids=tokens, attention_mask=mask).logits
        errors[f"{name} {parallel} predict"] = [(got - want).abs().max().item(), abs(len(got) - len(want))]
    if "evaluate" in paths:  # the loss of whole sequences, under every degree
        engine = Engine(copy.deepcopy(model), loss, strategy=Strategy(**degrees), process=job)
        with torch.no_grad():
            want = reference_loss(copy.deepcopy(model)).item()
        errors[f"{name} {parallel} evaluate"] = [abs(engine.evaluate(data, batch_size=GLOBAL)["loss"] - want)]
    for stage in stages:
        for acc in accumulations:
            for path in (p for p in paths if p in ("fit", "run", "export")):
                engine = Engine(
                    copy.deepcopy(model), loss, functools.partial(torch.optim.SGD, lr=LR),
                    strategy=Strategy(
                        sharding={"stage": stage}, gradient_merge={"k_steps": acc},
                        gradient_clip={"max_norm": no_clip.get(stage, clip)}, **degrees,
                    ),
                    process=job,
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
                    logged, norm = job.all_reduce_mean(logs["loss"]), logs["fetches"]["grad_norm"]
                local = sum(p.numel() for p in engine.module.parameters() if p.numel())
                state = engine.runtime.full_state_dict(on_every_rank=True)
                if path == "export":
                    state = exported(engine, model, out_dir / f"export-{name}-zero{stage}-acc{acc}")
                shares[f"{name} {parallel} {path} zero{stage} acc{acc}"] = local / sum(
                    v.numel() for k, v in state.items() if k in dict(model.named_parameters())
                )
                lengths[f"{name} {parallel} {path} zero{stage} acc{acc}"] = sorted(seen)
                want = unclipped.state_dict() if stage in no_clip else expected
                weight_error = max((state[k].float() - v).abs().max().item() for k, v in want.items())
                errors[f"{name} {parallel} {path} zero{stage} acc{acc}"] = [
                    weight_error,
                    abs(logged - ref_loss.item()),
                    abs(norm - ref_norm),  # run: the fetched grad_norm (fit logs none)
                ]
job.close()
(out_dir / f"rank{rank}.json").write_text(
    json.dumps({"errors": errors, "shares": shares, "lengths": lengths})
)
