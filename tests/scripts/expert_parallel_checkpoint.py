"""Run under torchrun on 2 ranks: checkpoints of a tiny Mixtral whose experts are split over the 2
ranks (DeepSpeed AutoEP), ZeRO-3, AdamW. A run that crashes after its step-2 checkpoint and resumes
must end with the weights of an uninterrupted run; `python -m framework.export` on that checkpoint
and loading whole weights into the split model must each fail with one line that says what works.

Usage: expert_parallel_checkpoint.py OUT_DIR. Writes OUT_DIR/rank<R>.json: {"resume_error": max
weight difference, "resumed_from": checkpoint, "export": message, "load": message}.
"""

import copy
import functools
import json
import sys
from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM

from framework import Callback, ConfigError, Engine, ProcessContext, Strategy
from framework.export import fp32_state_dict

out = Path(sys.argv[1])
torch.manual_seed(0)
config = MixtralConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2,
)  # fmt: skip
model = MixtralForCausalLM(config)
tokens = torch.randint(0, 64, (32, 16))
data = [{"input_ids": tokens[i], "labels": tokens[i]} for i in range(32)]  # 4 steps of 8


class CrashAt(Callback):
    """A crash right after the checkpoint of step `at`."""

    def __init__(self, at):
        self.at = at

    def on_checkpoint_saved(self, state):
        if state.global_step == self.at:
            raise KeyboardInterrupt


def engine():
    strategy = Strategy(sharding={"stage": 3}, expert_parallel={"degree": 2})
    return Engine(
        copy.deepcopy(model),
        "model",
        functools.partial(torch.optim.AdamW, lr=1e-2),
        strategy=strategy,
        process=job,
    )


def one_line_error(call):
    try:
        call()
    except ConfigError as error:
        return str(error)
    return None


job = ProcessContext.start(timeout_s=120)
save_dir = out / "checkpoints"
uninterrupted = engine()
uninterrupted.fit(data, epochs=1, batch_size=8, shuffle=False)
expected = uninterrupted.runtime.full_state_dict(on_every_rank=True)
try:
    engine().fit(
        data,
        epochs=1,
        batch_size=8,
        shuffle=False,
        save_dir=str(save_dir),
        save_freq=2,
        callbacks=[CrashAt(2)],
    )
except KeyboardInterrupt:
    pass
resumed = engine()
resumed.fit(data, epochs=1, batch_size=8, shuffle=False, save_dir=str(save_dir), resume="auto")
state = resumed.runtime.full_state_dict(on_every_rank=True)
weights = resumed.save(str(out / "weights.safetensors"), training=False)
result = {
    "resume_error": max((state[k] - v).abs().max().item() for k, v in expected.items()),
    "resumed_from": resumed.state.info.resumed_from,
    "export": one_line_error(lambda: fp32_state_dict(save_dir)),
    "load": one_line_error(lambda: resumed.load(weights)),
}
job.close()
(out / f"rank{job.rank}.json").write_text(json.dumps(result))
