"""Run under torchrun (or alone): two SGD steps of DPO on the same global batch of 8 pairs (a
tiny Llama, fp32) for ZeRO 0 and 3 x accumulation 1 and 2 must give plain torch's weights (the
loss a mean over the global batch's pairs) and log its loss and reward metrics. The full model
at ZeRO-0 uses a frozen reference copy, at ZeRO-3 reference log-probabilities computed before
training (by `fit` itself: the API's DPO(precompute_reference=True) means what it says); a LoRA model (peft) uses itself with its adapters disabled.

Usage: dpo_invariance.py OUT_DIR. Writes OUT_DIR/rank<R>.json: {"errors": {"<model> zero<S>
acc<A> <reference>": [max weight error, max loss error, max reward-metric error]} (the LoRA ZeRO-3 case also writes
OUT_DIR/metrics.jsonl), "moved":
{model: how far plain torch moved its weights}, "refused": the line that refuses to copy a model
built partitioned, "reference_share": the ZeRO-3 frozen copy's parameter elements on this rank /
the whole model's}.
"""

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from framework import Callback, Engine, ProcessContext, Strategy
from framework.backend.runtime import Runtime
from framework.data.datasets.preference import PairCollator, PairEncoder
from framework.errors import ConfigError
from framework.methods import DPO
from framework.methods.dpo import dpo_losses
from framework.methods.pairs import PAIR_METRICS, pair_stats
from framework.observe.loggers import MetricsFile
from tests.helpers.tiny_chat import tiny_chat_tokenizer, tiny_llama
from tests.helpers.tiny_pairs import PAIRS

out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
GLOBAL, LR, STEPS, BETA = 8, 0.5, 2, 0.5
tok = tiny_chat_tokenizer()
encoder = PairEncoder(tok, 256, ("prompt", "chosen", "rejected"))
# As chat messages (the rows this script was written with): on pairs of plain text the first
# step's rewards, where the policy is its reference, are ~1e-7 of rounding apart between the
# precomputed reference (batches of 4) and the step (a batch of 8), which flips rewards/accuracy.
AS_MESSAGES = [
    {
        k: [{"role": "user" if k == "prompt" else "assistant", "content": v}] if isinstance(v, str) else v
        for k, v in p.items()
    }
    for p in PAIRS
]
pairs = [encoder.encode(p, f"pair {i}") for i, p in enumerate(AS_MESSAGES)]
collate = PairCollator(tok.pad_token_id)
base = tiny_llama(tok, seed=0)


def lora_policy():
    """The base model with LoRA adapters whose B matrices are not zero (the policy differs from
    its reference, the base, from the first step)."""
    import peft

    torch.manual_seed(1)  # lora_A's initialisation
    model = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def full_policy():
    return copy.deepcopy(base)


def plain_torch(make_policy):
    """Weights, losses and reward metrics of plain torch on the whole batch, the reference being
    the base model."""
    model, reference = make_policy(), copy.deepcopy(base).eval()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    batch, logs = collate(pairs), []
    for _ in range(STEPS):
        with torch.no_grad():
            ref = [s.logps for s in pair_stats(reference, batch)]
        policy = pair_stats(model, batch, extras=True)
        losses, chosen, rejected = dpo_losses(*(s.logps for s in policy), *ref, BETA)
        logs.append(
            {
                "loss": losses.mean().item(),
                "rewards/chosen": chosen.mean().item(),
                "rewards/rejected": rejected.mean().item(),
                "rewards/margins": (chosen - rejected).mean().item(),
                "rewards/accuracies": (chosen > rejected).float().mean().item(),
            }
        )
        optimizer.zero_grad()
        losses.mean().backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, logs


class Logged(Callback):
    def __init__(self):
        self.logs = []

    def on_step_end(self, state):
        if state.log_now:
            self.logs.append(dict(state.logs))


# (name, policy, ZeRO stage, accumulation, reference): a frozen copy, stored log-probabilities,
# or (LoRA) the policy with its adapters disabled.
CASES = [
    ("full", full_policy, 0, 2, "copy"),
    ("full", full_policy, 3, 1, "precompute"),
    ("full", full_policy, 3, 2, "copy"),
    ("lora", lora_policy, 0, 1, "adapters"),
    ("lora", lora_policy, 3, 2, "adapters"),
]
wanted = {name: plain_torch(make) for name, make in (("full", full_policy), ("lora", lora_policy))}
errors, moved, share = {}, {}, 1.0
with ProcessContext.start("cpu") as process:
    for name, make, stage, acc, reference in CASES:
        want_weights, want_logs = wanted[name]
        dpo = DPO(
            beta=BETA,
            precompute_reference=reference == "precompute",
            reference=copy.deepcopy(base) if reference == "copy" else None,
        )
        strategy = Strategy(sharding={"stage": stage}, gradient_merge={"k_steps": acc})
        logged = Logged()
        callbacks = [logged]
        if name == "lora" and stage == 3:  # what the run's metrics.jsonl holds (rank 0 writes it)
            callbacks.append(MetricsFile(out_dir / "metrics.jsonl"))
        engine = Engine(
            make(), optimizer=lambda p: torch.optim.SGD(p, lr=LR), strategy=strategy, train_step=dpo,
            process=process, callbacks=callbacks,
        )  # fmt: skip
        # precompute_reference=True: fit computes the reference log-probabilities itself
        engine.fit(pairs, batch_size=GLOBAL, epochs=STEPS, shuffle=False, collate_fn=collate, log_freq=1)
        got = engine.runtime.full_state_dict(on_every_rank=True)
        assert len(logged.logs) == STEPS, logged.logs
        assert set(got) == set(want_weights), sorted(set(got) ^ set(want_weights))[:5]
        weight_error = max((got[k] - v).abs().max().item() for k, v in want_weights.items())
        loss_error = max(abs(g["loss"] - w["loss"]) for g, w in zip(logged.logs, want_logs))
        reward_error = max(
            abs(g[k] - w[k]) for g, w in zip(logged.logs, want_logs) for k in want_logs[0] if k != "loss"
        )
        assert all(name in g for g in logged.logs for name in PAIR_METRICS), logged.logs
        errors[f"{name} zero{stage} acc{acc} {reference}"] = [weight_error, loss_error, reward_error]
        if reference == "copy" and stage == 3:  # the frozen copy's share of its parameters on this rank
            params = list(dpo.reference.module.parameters())
            share = sum(p.ds_tensor.numel() for p in params) / sum(p.ds_numel for p in params)
        engine.close()
    runtime = Runtime(Strategy(sharding={"stage": 3}), process)
    with runtime.init_context():
        partitioned = torch.nn.Linear(4, 4)  # as ZeRO-3 builds a model too large for one rank
    try:
        DPO(beta=BETA).attach(SimpleNamespace(module=partitioned))
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    start = {"full": full_policy().state_dict(), "lora": lora_policy().state_dict()}
    moved = {
        n: max((v - start[n][k]).abs().max().item() for k, v in w.items()) for n, (w, _) in wanted.items()
    }
    (out_dir / f"rank{process.rank}.json").write_text(
        json.dumps({"errors": errors, "moved": moved, "refused": refused, "reference_share": share})
    )
