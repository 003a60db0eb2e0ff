"""GRPO (Shao et al. 2024): online RL with group-relative advantages, against rewards computed
by code; TRL's `GRPOTrainer`, its option and metric names, exact on every layout.

    python train.py model=hf_causal_lm model.path=DIR data=hf_prompts data.dataset.data_files=prompts.jsonl \\
        +objective=grpo "objective.reward_funcs=[my_rewards.format_ok]" trainer.batch_size=64
    Engine(model, optimizer=..., train_step=GRPO(reward_funcs=[format_ok], num_generations=8))

One optimizer step: the step's prompts (`trainer.batch_size` counts completions, global: a
multiple of `num_generations` G, so batch_size / G prompts) are pulled for every accumulation
step at once; the policy samples G completions of each (`framework.methods.rollout`: the
weights gathered once per rollout, each completion from its own seeded generator); the reward
functions score them (`framework.methods.rewards`); each completion's advantage is its reward
against its group's; then, `num_iterations` times, one optimizer step over them with the clipped
objective (`epsilon`, `epsilon_high`) and, with `beta` > 0, the KL to the reference (the model
with its adapters off, or a frozen copy partitioned like the policy). `loss_type` normalises as
TRL does: `grpo` a mean over completions of their token means, `dr_grpo` a sum over tokens /
(completions x max_completion_length), `dapo` a mean over every completion token of the global
batch (its count gathered before the update, so it is exact on every layout).

Logged with TRL's names, per step: reward, reward_std, rewards/<function>/mean and /std,
frac_reward_zero_std, completions/mean_length, /min_length, /max_length,
completions/clipped_ratio; over the completion tokens: entropy, clip_ratio/region_mean (and
/low_mean, /high_mean), kl (beta > 0). Every `log_completions_every` steps rank 0 keeps a sample
of prompts, completions and rewards for the run's completions file (`step_samples`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from framework.errors import ConfigError
from framework.methods.base import Method
from framework.methods.reference import Reference
from framework.methods.rewards import reward_functions
from framework.methods.rollout import Batch, Generator, token_logps
from framework.methods.scoring import Scored, score_rollout
from framework.methods.tokens import Meter, TokenScoring

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")


@dataclass
class GRPOConfig(TokenScoring):
    """GRPO's options, named as TRL's `GRPOConfig` names them."""

    num_generations: int = 8  # G: completions sampled per prompt
    max_completion_length: int = 512  # tokens a completion may have (one cut there counts as clipped)
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # sample from the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # sample from the k most likely tokens (0: all)
    beta: float = 0.0  # weight of the KL to the reference (0: no reference model at all)
    epsilon: float = 0.2  # the clipped ratio's lower bound is 1 - epsilon
    epsilon_high: float | None = None  # its upper bound is 1 + epsilon_high (default: epsilon)
    num_iterations: int = 1  # optimizer steps over each rollout
    loss_type: str = "dapo"  # grpo | dr_grpo | dapo: how the token losses are averaged
    scale_rewards: str = "group"  # divide advantages by the group's std, the batch's, or none
    # import paths (module.function) or callables, f(prompts, completions, **columns) -> rewards
    reward_funcs: list[Any] = field(default_factory=list)
    reward_weights: list[float] | None = None  # one per function (default: 1 each)
    log_completions_every: int = 10  # optimizer steps between samples in the completions file (0: never)

    def __post_init__(self) -> None:
        super().__post_init__()
        about = ConfigError.about
        if self.num_generations < 2:
            raise about(
                "GRPO", "num_generations", self.num_generations, "at least 2 (advantages compare a group)"
            )
        if self.max_completion_length < 1:
            raise about("GRPO", "max_completion_length", self.max_completion_length, "at least 1 token")
        if not self.temperature > 0:
            raise about("GRPO", "temperature", self.temperature, "must be > 0")
        if not 0 < self.top_p <= 1:
            raise about("GRPO", "top_p", self.top_p, "must be in (0, 1]")
        if self.loss_type not in LOSS_TYPES:
            raise about("GRPO", "loss_type", self.loss_type, f"one of {', '.join(LOSS_TYPES)}")
        if str(self.scale_rewards) not in SCALES:
            raise about("GRPO", "scale_rewards", self.scale_rewards, f"one of {', '.join(SCALES)}")
        if self.num_iterations < 1 or self.beta < 0 or self.epsilon < 0:
            bad = next(
                n for n in ("num_iterations", "beta", "epsilon") if getattr(self, n) < (n == "num_iterations")
            )
            raise about(
                "GRPO", bad, getattr(self, bad), "must be >= 1" if bad == "num_iterations" else "must be >= 0"
            )


class GRPO(Method):
    """GRPO as an iterator step (see the module doc). `tokenizer`: the prompts' (default: the one
    the data carries, `data=hf_prompts`); `generator`: what samples (default `HFGenerate`);
    `reference`: a frozen copy of the model (default: made when an Engine takes the method and
    beta > 0, unless the model has adapters)."""

    name = "grpo"
    Config = GRPOConfig

    def __init__(
        self,
        config: GRPOConfig | None = None,
        *,
        tokenizer: Any = None,
        generator: Generator | None = None,
        reference: torch.nn.Module | None = None,
        **options: Any,
    ):
        super().__init__(config, **options)
        c = self.config
        self.functions, self.weights = reward_functions(c.reward_funcs, c.reward_weights)
        self.tokenizer, self.generator, self.reference = tokenizer, generator, Reference(reference)
        per_step = ["reward", "reward_std", "frac_reward_zero_std", "completions/mean_length"]
        per_step += ["completions/min_length", "completions/max_length", "completions/clipped_ratio"]
        per_step += [f"rewards/{f.name}/{s}" for f in self.functions for s in ("mean", "std")]
        tokens = ["entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"]
        tokens += ["kl"] if c.beta > 0 else []
        self.meter, self.eval_meter = Meter(tuple(per_step + tokens)), Meter(("reward", "reward_std"))
        self.samples: list[dict[str, Any]] = []  # rank 0's sample of the last rollout, when one was due

    # ------------------------------------------------------------------ what the engine asks
    def rows_per_batch(self, batch_size: int) -> int:
        """The prompts of a global batch of `batch_size` completions."""
        g = self.config.num_generations
        if batch_size % g:
            raise ConfigError.about(
                "fit", "batch_size", batch_size, f"counts completions: a multiple of num_generations={g}"
            )
        return batch_size // g

    def updates_per_batch(self) -> int:
        """Optimizer steps per rollout (`num_iterations`)."""
        return int(self.config.num_iterations)

    def attach(self, engine: Any) -> None:
        """The frozen reference (beta > 0, no adapters), made before DeepSpeed."""
        if not callable(getattr(engine.module, "generate", None)):
            raise ConfigError(
                f"GRPO samples with transformers' generate, which {type(engine.module).__name__} lacks: use a "
                "Hugging Face causal LM (model=hf_causal_lm)"
            )
        if self.config.beta > 0:
            self.reference.attach(engine.module, "GRPO", "set beta=0, or train adapters (+adapter=lora)")

    def prepare_data(self, engine: Any, data: Any, batch_size: int, collate_fn: Any) -> Any:
        """The data as it is; its tokenizer, unless one was given."""
        if data is not None and self.tokenizer is None:
            info = getattr(data, "info", None) or {}
            self.tokenizer = getattr(data, "tokenizer", None) or info.get("tokenizer")
        return data

    # ------------------------------------------------------------------ one step
    def __call__(self, engine: Any, dataloader_iter: Any) -> dict[str, Any]:  # type: ignore[override]
        """Rollout, then `num_iterations` optimizer steps over it; returns the mean loss."""
        rt = engine.runtime
        prompts = [next(dataloader_iter) for _ in range(rt.strategy.accumulation_steps)]
        step = engine.state.global_step
        scored = score_rollout(self, engine, prompts, step)
        self._extras(engine, scored)
        losses = []
        for _ in range(self.config.num_iterations):
            for batch in scored.batches:
                loss = self.loss(engine, batch, scored)
                engine.backward(loss)
                losses.append(loss.detach())
            engine.step()
        self.meter.add(scored.step_metrics)
        self.samples = scored.samples
        return {"loss": torch.stack(losses).mean()}

    def _extras(self, engine: Any, scored: Scored) -> None:
        """The sampling policy's log-probabilities (num_iterations > 1) and the reference's (beta > 0)."""
        with torch.no_grad():
            for batch in scored.batches:
                if self.config.num_iterations > 1:
                    batch.old_logps = token_logps(engine.model, batch, chunk_size=self.config.chunking)[0]
                if self.config.beta > 0:
                    with self.reference.model(engine) as reference:
                        batch.ref_logps = token_logps(reference, batch, chunk_size=self.config.chunking)[0]

    def loss(self, engine: Any, batch: Batch, scored: Scored) -> torch.Tensor:
        """The clipped objective (and KL) of one micro-batch, normalised as `loss_type` says; its
        token statistics join the meter."""
        c = self.config
        logps, entropy = token_logps(engine.model, batch, True, self.config.chunking)
        assert entropy is not None
        old = batch.old_logps if batch.old_logps is not None else logps.detach()
        ratio = torch.exp(logps - old)
        high = c.epsilon if c.epsilon_high is None else c.epsilon_high
        a = batch.advantages.to(logps.device, logps.dtype).unsqueeze(1)
        per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - c.epsilon, 1 + high) * a)
        mask = batch.completion_mask.to(logps.device, logps.dtype)
        tokens = mask.sum()
        low_clip = ((ratio < 1 - c.epsilon) & (a < 0)).to(mask.dtype) * mask
        high_clip = ((ratio > 1 + high) & (a > 0)).to(mask.dtype) * mask
        stats = {
            "entropy": ((entropy * mask).sum(), tokens),
            "clip_ratio/low_mean": (low_clip.sum(), tokens),
            "clip_ratio/high_mean": (high_clip.sum(), tokens),
            "clip_ratio/region_mean": ((low_clip + high_clip).sum(), tokens),
        }
        if c.beta > 0:
            assert batch.ref_logps is not None
            delta = batch.ref_logps - logps
            kl = torch.exp(delta) - delta - 1
            per_token = per_token + c.beta * kl
            stats["kl"] = ((kl.detach() * mask).sum(), tokens)
        self.meter.add(stats)
        return self._normalised(per_token * mask, mask, engine, scored.tokens)

    def _normalised(
        self, summed: torch.Tensor, mask: torch.Tensor, engine: Any, global_tokens: float
    ) -> torch.Tensor:
        """`summed` (per-token losses, masked) as `loss_type` averages it, for a micro-batch whose
        losses DeepSpeed then averages over accumulation steps and ranks."""
        c = self.config
        if c.loss_type == "grpo":
            return (summed.sum(-1) / mask.sum(-1).clamp_min(1)).mean()
        if c.loss_type == "dr_grpo":
            return summed.sum() / (summed.shape[0] * c.max_completion_length)
        rt = engine.runtime  # dapo: a mean over the global batch's completion tokens
        return summed.sum() * (rt.strategy.accumulation_steps * rt.dp_size) / max(global_tokens, 1.0)

    # ------------------------------------------------------------------ logs, validation, state
    def step_logs(self, device: torch.device | None = None) -> dict[str, float]:
        """The metrics since the last logging point (collective)."""
        return self.meter.read(device)

    def step_samples(self) -> list[dict[str, Any]]:
        """Rank 0's sample of the last rollout, when one was due (read once)."""
        samples, self.samples = self.samples, []
        return samples

    def eval_step(self, engine: Any, batch: Any) -> torch.Tensor:
        """The negative mean reward of a validation batch's completions (lower is better); its
        rewards join the validation meter."""
        scored = score_rollout(self, engine, [batch], engine.state.global_step, validation=True)
        rewards = scored.rewards
        counted = (~rewards.isnan()).sum()
        self.eval_meter.add(
            {"reward": (torch.nansum(rewards), counted), "reward_std": (scored.reward_std, 1)}
        )
        return -torch.nanmean(rewards)

    def eval_logs(self, device: torch.device | None = None) -> dict[str, float]:
        """reward and reward_std of the validation prompts (logged as val_reward, ...)."""
        return self.eval_meter.read(device)

    def step_state(self) -> dict[str, Any]:
        """The metrics of the steps since the last logging point."""
        return {"meter": self.meter.state_dict()}

    def load_step_state(self, states: list[dict[str, Any]], device: torch.device | None = None) -> None:
        """Put back `step_state`s (this rank's, or every saved rank's on one rank)."""
        self.meter.load_sums([s["meter"] for s in states if "meter" in s], device)
