"""Run under torchrun (or alone): two SGD steps of DPO on the same global batch of 8 pairs (a
tiny Llama, fp32) for ZeRO 0 and 3 x accumulation 1 and 2 must give plain torch's weights (the
loss a mean over the global batch's pairs) and log its loss and reward metrics. ZeRO-0 uses a
frozen reference copy, ZeRO-3 reference log-probabilities computed before training.

Usage: dpo_invariance.py OUT_DIR. Writes OUT_DIR/rank<R>.json: {"errors": {"zero<S> acc<A>":
[max weight error, max loss error, max reward-metric error]}, "moved": how far plain torch
moved the weights}.
"""

import copy
import json
import sys
from pathlib import Path

import torch

from framework import Callback, Engine, ProcessContext, Strategy
from framework.data.datasets.preference import PairCollator, PairEncoder
from framework.engine.preference import DPO, RewardMeter, dpo_losses, pair_logps, with_reference_logps
from tests.helpers.tiny_chat import tiny_chat_tokenizer, tiny_llama
from tests.helpers.tiny_pairs import PAIRS

out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
GLOBAL, LR, STEPS, BETA = 8, 0.5, 2, 0.5
tok = tiny_chat_tokenizer()
encoder = PairEncoder(tok, 256, ("prompt", "chosen", "rejected"))
pairs = [encoder.encode(p, f"pair {i}") for i, p in enumerate(PAIRS)]
collate = PairCollator(tok.pad_token_id)
base = tiny_llama(tok, seed=0)


def plain_torch():
    """Weights, losses and reward metrics of plain torch on the whole batch."""
    model, reference = copy.deepcopy(base), copy.deepcopy(base).eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batch, logs = collate(pairs), []
    for _ in range(STEPS):
        with torch.no_grad():
            ref = pair_logps(reference, batch, False)
        losses, chosen, rejected = dpo_losses(*pair_logps(model, batch, False), *ref, BETA)
        meter = RewardMeter()
        meter.add(chosen, rejected)
        logs.append({"loss": losses.mean().item(), **meter.read()})
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


want_weights, want_logs = plain_torch()
errors = {}
with ProcessContext.start("cpu") as process:
    for stage in (0, 3):
        for acc in (1, 2):
            precompute = stage == 3
            model = copy.deepcopy(base)
            dpo = DPO(
                beta=BETA,
                precompute_reference=precompute,
                reference=None if precompute else copy.deepcopy(base),
            )
            strategy = Strategy(sharding={"stage": stage}, gradient_merge={"k_steps": acc})
            logged = Logged()
            engine = Engine(
                model, optimizer=lambda p: torch.optim.SGD(p, lr=LR), strategy=strategy, train_step=dpo,
                process=process, callbacks=[logged],
            )  # fmt: skip
            data = pairs
            if precompute:
                engine.prepare("train", GLOBAL)
                data = with_reference_logps(engine, pairs, 4, collate)
            engine.fit(data, batch_size=GLOBAL, epochs=STEPS, shuffle=False, collate_fn=collate, log_freq=1)
            got = engine.runtime.full_state_dict(on_every_rank=True)
            assert len(logged.logs) == STEPS, logged.logs
            weight_error = max((got[k] - v).abs().max().item() for k, v in want_weights.items() if k in got)
            loss_error = max(abs(g["loss"] - w["loss"]) for g, w in zip(logged.logs, want_logs))
            reward_error = max(
                abs(g[k] - w[k]) for g, w in zip(logged.logs, want_logs) for k in RewardMeter.NAMES
            )
            errors[f"zero{stage} acc{acc}"] = [weight_error, loss_error, reward_error]
            engine.close()
    moved = max((v - base.state_dict()[k]).abs().max().item() for k, v in want_weights.items())
    (out_dir / f"rank{process.rank}.json").write_text(json.dumps({"errors": errors, "moved": moved}))
