"""GRPO: against TRL's GRPOTrainer, the time of a step by phase, generated tokens/s, memory, and
`experiment=grpo_tiny` on three seeds, side by side in one run. Every process computes on one
thread (OMP_NUM_THREADS=1 unless set): alike, and steadier on a shared machine.

* **vs TRL** (issue 47's speed acceptance): the 40-step job on one process, ZeRO-0, a tiny Llama
  built from a config (conf/model/hf_llama.yaml with vocab 68, the tiny_chat tokenizer) and
  saved once, so both load the same weights; examples/tiny_chat/prompts.jsonl, reward
  `meow_share`, G=8, 8 completion tokens, temperature 1, beta 0, AdamW lr 5e-3 (weight decay
  0.01, no clipping), constant schedule, 64 completions a step. Ours is the composed config of
  the acceptance command given to `framework.build`; TRL's `GRPOTrainer` gets the equivalent
  `GRPOConfig` (the chat prompts rendered to text, the same token ids: one Arrow column cannot
  hold strings and message lists). Timed: `run.fit()` / `trainer.train()`, each in a fresh
  process, model loading left out, alternated (2 runs each at --quick, 3 else; the median).
  Rewards: the logged mean of each step.
* **Step split**: wrappers timing GRPO's phases from outside (nothing in the framework changed,
  the numerics untouched), per step after the first: generation (`HFGenerate.generate_all`,
  ZeRO-3's gather included), reward (the reward functions), scoring (the rest of the rollout:
  decoding, advantages, the all-gather of rewards, which waits for the slowest rank), update
  (the rest of the method's step: reference log-probabilities, forward, backward, optimizer
  step) and other (the loop between two steps: data, logging).
* **Generation**: a larger Llama (hidden 256, 4 layers, so ZeRO-3 partitions it) rolled out by
  GRPO steps under ZeRO-3 x 2 and ZeRO-0 x 1 (32 tokens, 64 completions a step); on one process
  the same rollouts are then replayed on the plain model loaded from disk, through the same
  `generate` call (the same sampler and seeds: the first rollout, before any update, must give
  the same tokens) and through transformers' own `do_sample=True`. Generated tokens/s over
  every rank; also the gather alone (entering `Runtime.generating()` with nothing to do), and
  one rollout through DeepSpeed's ZeRO-3 hooks, which gather each layer for every new token.
* **Memory**: peak RSS per rank above the RSS after imports, with beta > 0: LoRA (the reference
  is the model with adapters off) and full fine-tuning (a frozen copy, partitioned) under
  ZeRO-3 x 2, full under ZeRO-0 x 1 (hidden 512, 8 layers); and the weights rank 0 holds for
  the policy and for the reference.
* **grpo_tiny**: `python train.py experiment=grpo_tiny trainer.seed=S trainer.log_freq=1` for
  seeds 0, 1, 2 (ZeRO-3 x 2): whole-process wall time, the mean reward of the first step, of
  the first and last 10 steps, and the first step whose mean reaches 0.8.

    python -m benchmarks.grpo [--quick | --smoke]
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import end_job, parse_args, print_table, quiet, start_job, write

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "examples" / "tiny_chat" / "prompts.jsonl"
REWARD = "examples.tiny_chat.rewards.meow_share"
G, LR, BETA = 8, 5e-3, 0.04
SIZES = {  # hidden, layers
    "tiny": (128, 2),  # conf/model/hf_llama.yaml
    "gen": (256, 4),
    "mem": (512, 8),
    "smoke": (64, 2),
}


def _mb(n: float) -> float:
    return n / 2**20


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def save_llama(directory: Path, size: str, seed: int = 0) -> str:
    """A Llama built from a config (hf_llama.yaml's shape at "tiny", vocab 68) with the tiny_chat
    tokenizer, saved with save_pretrained: what both frameworks load."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    hidden, layers = SIZES[size]
    tok = AutoTokenizer.from_pretrained(ROOT / "examples" / "tiny_chat")
    heads = 4 if hidden <= 128 else 8
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 344 // 128,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        max_position_embeddings=256, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


def overrides(
    model_dir: str, *, steps: int, stage: int = 0, devices: int = 1, batch: int = 64, length: int = 8,
    beta: float = 0.0, lr: float = LR, seed: int = 0, extra: tuple[str, ...] = (),
) -> list[str]:  # fmt: skip
    """The command line of issue 47's acceptance job, at this layout and size."""
    return [
        "model=hf_causal_lm", f"model.path={model_dir}", "data=hf_prompts", f"data.dataset.data_files={PROMPTS}",
        "data.dataset.val_fraction=0", "+objective=grpo", f"objective.num_generations={G}",
        f"objective.max_completion_length={length}", "objective.temperature=1.0", f"objective.beta={beta}",
        f"objective.reward_funcs=[{REWARD}]", "optimizer=adamw", f"optimizer.lr={lr}", "scheduler=constant",
        "metrics=none", f"trainer.batch_size={batch}", f"trainer.max_steps={steps}", "trainer.monitor=loss",
        f"strategy=zero{stage}", f"trainer.devices={devices}", "trainer.log_freq=1",
        "trainer.checkpoint.enabled=false", f"trainer.seed={seed}", *extra,
    ]  # fmt: skip


def compose(argv: list[str]) -> dict[str, Any]:
    """conf/train.yaml composed with `argv` as train.py composes it, resolved to plain data."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from framework.cli.argv import normalize
    from framework.cli.config import GROUPS, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=normalize(argv, set(GROUPS)))
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


# ---------------------------------------------------------------------- timing GRPO from outside
class Phases:
    """Per optimizer step, the seconds GRPO spends in each phase (see the module doc), timed by
    wrappers put on its functions in this (worker) process; `record` keeps each rollout's
    requests and completions."""

    def __init__(self, record: bool = False):
        self.steps: list[dict[str, Any]] = []
        self.record = record
        self.rollouts: list[tuple[Any, Any]] = []

    def install(self) -> Phases:
        from framework.methods import grpo, rollout, scoring

        def add(key: str, seconds: float) -> None:
            if self.steps:
                self.steps[-1][key] = self.steps[-1].get(key, 0.0) + seconds

        call, score_rollout = grpo.GRPO.__call__, grpo.score_rollout
        generate_all, score = rollout.HFGenerate.generate_all, scoring.score

        # the argument's name marks an iterator step (framework.engine.steps.takes_iterator)
        def timed_call(method: Any, engine: Any, dataloader_iter: Any) -> Any:
            start = time.perf_counter()
            self.steps.append({"start": start})
            out = call(method, engine, dataloader_iter)
            add("call", time.perf_counter() - start)
            return out

        def timed_rollout(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = score_rollout(*args, **kwargs)
            add("rollout", time.perf_counter() - start)
            return out

        def timed_generate(generator: Any, engine: Any, requests: Any) -> Any:
            start = time.perf_counter()
            out = generate_all(generator, engine, requests)
            add("generation", time.perf_counter() - start)
            add("tokens", float(sum(o.shape[0] * o.shape[1] for o in out)))
            if self.record:
                self.rollouts.append((requests, out))
            return out

        def timed_score(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = score(*args, **kwargs)
            add("reward_fns", time.perf_counter() - start)
            return out

        grpo.GRPO.__call__ = timed_call  # type: ignore[method-assign]
        grpo.score_rollout = timed_rollout
        rollout.HFGenerate.generate_all = timed_generate  # type: ignore[method-assign]
        scoring.score = timed_score
        return self

    def split(self, skip: int = 1) -> dict[str, float]:
        """Mean milliseconds per step of each phase over the steps after the first `skip` that
        have a next step (whose start ends theirs)."""
        steps = self.steps[skip:] if len(self.steps) > skip + 1 else self.steps
        timed = [(s, n["start"] - s["start"]) for s, n in zip(steps, steps[1:])] or [
            (s, s["call"]) for s in steps
        ]

        def mean(values: list[float]) -> float:
            return 1000 * sum(values) / len(values)

        out = {
            "step_ms": mean([t for _, t in timed]),
            "generation_ms": mean([s["generation"] for s, _ in timed]),
            "reward_ms": mean([s["reward_fns"] for s, _ in timed]),
            "scoring_ms": mean([s["rollout"] - s["generation"] - s["reward_fns"] for s, _ in timed]),
            "update_ms": mean([s["call"] - s["rollout"] for s, _ in timed]),
            "other_ms": mean([t - s["call"] for s, t in timed]),
        }
        for key in ("generation", "reward", "scoring", "update", "other"):
            out[f"{key}_share"] = out[f"{key}_ms"] / out["step_ms"]
        return out

    def generated(self, skip: int = 1) -> tuple[float, float]:
        """(tokens generated, seconds generating) over the steps after the first `skip`."""
        steps = self.steps[skip:] if len(self.steps) > skip else self.steps
        return sum(s["tokens"] for s in steps), sum(s["generation"] for s in steps)


def _step_rewards(out_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["reward"] for r in records if r.get("kind") == "step" and "reward" in r]


def _ends(rewards: list[float]) -> dict[str, float]:
    n = min(10, len(rewards))
    return {"reward_first10": sum(rewards[:n]) / n, "reward_last10": sum(rewards[-n:]) / n}


def _held_mb(module: Any) -> float:
    """Megabytes of `module`'s weights on this rank (a ZeRO-3 partition, or every weight)."""
    module = getattr(module, "module", module)  # a DeepSpeed engine: its module
    return _mb(
        sum(
            (p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()) * p.element_size()
            for p in module.parameters()
        )
    )


# ---------------------------------------------------------------------- workers
def ours_worker(jobs: list[tuple[dict[str, Any], str, int]]) -> list[dict[str, Any]]:
    """GRPO jobs, one after the other, from composed configs on every rank (`framework.build`,
    then `fit`): per job (tree, task, steps left out of the split), the fit time, the step split
    and what `task` measures besides; rank 0's rows. One job per fresh worker, but at --smoke."""
    import torch

    import framework

    quiet()
    start_job()  # the jobs' runs join this process group (a group cannot be made twice in a launch)
    phases = Phases().install()
    rows = []
    for tree, task, skip in jobs:
        phases.steps, phases.rollouts, phases.record = [], [], task == "generation"
        baseline = _rss()
        with tempfile.TemporaryDirectory() as tmp:
            with framework.build(tree, tmp) as run:
                job = run.engine.process
                start = time.perf_counter()
                run.fit()
                row: dict[str, Any] = {
                    "seconds": time.perf_counter() - start,
                    "threads": torch.get_num_threads(),
                }
                peaks = job.all_gather_object((_peak(), baseline))
                row["peak_rss_MB"] = max(_mb(p) for p, _ in peaks)
                row["peak_minus_baseline_MB"] = max(_mb(p - b) for p, b in peaks)
                row["per_rank_peak_minus_baseline_MB"] = [round(_mb(p - b), 1) for p, b in peaks]
                row.update(phases.split(skip))
                if task == "vs_trl" and job.is_main:
                    rewards = _step_rewards(Path(tmp))
                    row.update({**_ends(rewards), "rewards": [round(r, 4) for r in rewards]})
                if task == "generation":
                    row.update(_generation(run, phases, skip, tree))
                if task == "memory":
                    reference = run.engine.train_step_fn.reference.module
                    row["policy_held_MB"] = _held_mb(run.engine.module)
                    row["reference_held_MB"] = _held_mb(reference) if reference is not None else 0.0
                job.barrier()
        rows.append(row)
    end_job()
    return rows


def _generation(run: Any, phases: Phases, skip: int, tree: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s of the rollouts over every rank, the gather alone, one rollout through ZeRO-3's
    hooks and, on one process, the plain model replaying the same rollouts."""
    import torch

    engine, job = run.engine, run.engine.process
    tokens, seconds = phases.generated(skip)
    every = job.all_gather_object((tokens, seconds))
    out: dict[str, Any] = {
        "tokens": sum(t for t, _ in every),
        "tokens_per_s": sum(t for t, _ in every) / max(s for _, s in every),
    }
    params = list(engine.module.parameters())
    partitioned = [p for p in params if hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel]
    out["partitioned_share"] = sum(p.ds_numel for p in partitioned) / sum(
        getattr(p, "ds_numel", p.numel()) for p in params
    )
    gathers = []
    for _ in range(3):
        job.barrier()
        start = time.perf_counter()
        with engine.runtime.generating():
            pass
        gathers.append(time.perf_counter() - start)
    out["gather_ms"] = 1000 * sorted(gathers)[1]
    requests, _ = phases.rollouts[-1]
    ids, mask, seeds = requests[0]
    length = int(tree["objective"]["max_completion_length"])
    if partitioned:  # generate through DeepSpeed's hooks (eos off: every rank runs every token)
        from framework.integrations import generation

        engine.runtime.train(False)
        job.barrier()
        start = time.perf_counter()
        done = generation.sample(
            engine.module, ids, mask, [torch.Generator().manual_seed(s) for s in seeds], length
        )
        out["per_layer_tokens_per_s"] = (
            job.world_size * done.numel() / max(job.all_gather_object(time.perf_counter() - start))
        )
    if job.world_size == 1:
        out.update(_plain(tree, phases, skip, length))
    return out


def _plain(tree: dict[str, Any], phases: Phases, skip: int, length: int) -> dict[str, Any]:
    """The rollouts replayed on the plain model loaded from disk: the same `generate` call (the same
    sampler and seeds), then transformers' own sampling."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from framework.integrations import generation

    directory = tree["model"]["path"]
    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()

    def replay(ids: Any, mask: Any, seeds: list[int]) -> Any:
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        return generation.sample(
            model, ids, mask, generators, length, 1.0, 0, 1.0, tok.eos_token_id, tok.pad_token_id
        )

    first, expected = phases.rollouts[0]  # sampled before the first update: the weights on disk
    same = all(torch.equal(replay(*request), out) for request, out in zip(first, expected))
    tokens, seconds, hf_tokens, hf_seconds = 0, 0.0, 0, 0.0
    for requests, _ in phases.rollouts[skip:] if len(phases.rollouts) > skip else phases.rollouts:
        for ids, mask, seeds in requests:
            start = time.perf_counter()
            tokens += replay(ids, mask, seeds).numel()
            seconds += time.perf_counter() - start
            torch.manual_seed(0)
            start = time.perf_counter()
            with torch.no_grad():
                hf = model.generate(
                    input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=length, top_k=0,
                    temperature=1.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                )  # fmt: skip
            hf_seconds += time.perf_counter() - start
            hf_tokens += hf[:, ids.shape[1] :].numel()
    return {
        "plain_tokens_per_s": tokens / seconds,
        "plain_same_tokens": same,
        "hf_sampling_tokens_per_s": hf_tokens / hf_seconds,
    }


def trl_worker(model_dir: str, steps: int, batch: int, seed: int, threads: int) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same job (see the module doc), in a fresh process."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from examples.tiny_chat.rewards import meow_share

    hf_logging.set_verbosity_error()
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    for row in rows:  # chat prompts as the text their template renders: the same token ids as ours
        if not isinstance(row["prompt"], str):
            row["prompt"] = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    baseline = _rss()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, report_to=[], logging_steps=1, save_strategy="no",
            disable_tqdm=True, per_device_train_batch_size=batch, generation_batch_size=batch,
            num_generations=G, max_completion_length=8, temperature=1.0, beta=0.0, learning_rate=LR,
            lr_scheduler_type="constant", optim="adamw_torch", weight_decay=0.01, max_grad_norm=0.0,
            max_steps=steps, seed=seed,
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=model_dir, reward_funcs=meow_share, args=args, train_dataset=Dataset.from_list(rows)
        )
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "seconds": seconds,
        "threads": torch.get_num_threads(),
        "peak_rss_MB": _mb(_peak()),
        "peak_minus_baseline_MB": _mb(_peak() - baseline),
        **_ends(rewards),
        "rewards": [round(r, 4) for r in rewards],
    }


def in_workers(jobs: list[tuple[dict[str, Any], str, int]], together: bool = False) -> list[dict[str, Any]]:
    """Each job in fresh workers (`together`: all of them in the same ones, which must agree on
    the number of processes)."""
    from framework.process.launch import spawn

    groups = [jobs] if together else [[job] for job in jobs]
    return [
        row
        for group in groups
        for row in spawn(ours_worker, (group,), int(group[0][0]["trainer"]["devices"]), timeout_s=600)
    ]


def in_fresh_process(fn: Any, *args: Any) -> Any:
    """`fn(*args)` in a fresh interpreter, outside any launcher's environment."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


# ---------------------------------------------------------------------- the parts
def vs_trl(ours: list[dict[str, Any]], model_dir: str, steps: int, repeats: int) -> list[dict[str, Any]]:
    """TRL's runs of the job (alternated with ours, `repeats` times, when `ours` is empty; each in
    a fresh process) and the two rows: median seconds and their ratio."""
    base = {"part": "vs TRL", "ranks": 1, "steps": steps}
    threads = int(os.environ.get("OMP_NUM_THREADS") or 1)
    try:
        import trl
    except ImportError:
        trl = None
    theirs: list[dict[str, Any]] = []
    tree = compose(overrides(model_dir, steps=steps))
    for _ in range(repeats):
        if len(ours) < repeats:
            ours += in_workers([(tree, "vs_trl", 1)])
        if trl is not None:
            theirs.append(in_fresh_process(trl_worker, model_dir, steps, 64, 0, threads))
    rows = [{**base, "setup": "hydraspeed, ZeRO-0", **_median_run(ours)}]
    if trl is None:
        return rows + [
            {**base, "setup": "TRL GRPOTrainer", "seconds": None, "status": "skipped: trl not installed"}
        ]
    rows.append({**base, "setup": f"TRL {trl.__version__} GRPOTrainer", **_median_run(theirs)})
    rows[0]["ours_over_trl"] = rows[0]["seconds"] / rows[1]["seconds"]
    rows[0]["ours_over_trl_runs"] = [round(a["seconds"] / b["seconds"], 3) for a, b in zip(ours, theirs)]
    return rows


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median time (the first run's rewards: the same seed gives the same rewards),
    with every run's seconds."""
    middle = sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]
    return {**middle, **{k: runs[0][k] for k in ("reward_first10", "reward_last10", "rewards")},
            "seconds_runs": [round(r["seconds"], 3) for r in runs]}  # fmt: skip


def grpo_tiny(seeds: list[int]) -> list[dict[str, Any]]:
    """`python train.py experiment=grpo_tiny` per seed: whole-process wall time and rewards."""
    rows = []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for seed in seeds:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable, "train.py", "experiment=grpo_tiny", f"trainer.seed={seed}", "trainer.log_freq=1",
                f"hydra.run.dir={tmp}",
            ]  # fmt: skip
            start = time.perf_counter()
            subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
            wall = time.perf_counter() - start
            rewards = _step_rewards(Path(tmp))
        reached = next((i + 1 for i, r in enumerate(rewards) if r >= 0.8), None)
        rows.append({
            "part": "grpo_tiny", "setup": f"seed {seed}", "ranks": 2, "seconds": wall, "steps": len(rewards),
            "reward_step1": rewards[0], **_ends(rewards), "first_step_at_0.8": reached,
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Every part, side by side (see the module doc). At --smoke the jobs of one process count
    share a worker and grpo_tiny is not run: it checks the script, it measures nothing."""
    args = parse_args(__doc__, argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # every process alike, steadier on a shared machine
    smoke, quick = args.smoke, args.quick
    steps, repeats = (3, 1) if smoke else (40, 2 if quick else 3)
    gen_size, mem_size = ("smoke", "smoke") if smoke else ("gen", "mem")
    gen_steps, gen_length = (3, 8) if smoke else ((3, 32) if quick else (8, 32))
    started = time.perf_counter()

    def done(part: str) -> None:
        print(f"== {part}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        tiny = save_llama(Path(tmp) / "tiny", "tiny")
        gen = save_llama(Path(tmp) / "gen", gen_size)
        mem = save_llama(Path(tmp) / "mem", mem_size)
        labels: list[dict[str, Any]] = [
            {"part": "vs TRL", "setup": "hydraspeed, ZeRO-0", "ranks": 1, "steps": steps},
            {"part": "step split", "setup": "hydraspeed, ZeRO-3", "ranks": 2, "steps": steps},
        ]
        jobs = [
            (compose(overrides(tiny, steps=steps)), "vs_trl", 1),
            (compose(overrides(tiny, steps=steps, stage=3, devices=2)), "split", 1),
        ]
        for stage, devices in ((3, 2), (0, 1)):
            labels.append(
                {"part": "generation", "setup": f"rollout, ZeRO-{stage}", "ranks": devices, "stage": stage}
            )
            argv = overrides(gen, steps=gen_steps, stage=stage, devices=devices, length=gen_length)
            jobs.append((compose(argv), "generation", 1))
        for name, stage, devices, extra in (
            ("LoRA r=8", 3, 2, ("+adapter=lora",)),
            ("full", 3, 2, ()),
            ("full", 0, 1, ()),
        ):
            labels.append(
                {
                    "part": "memory",
                    "setup": f"{name}, beta {BETA}, ZeRO-{stage}",
                    "ranks": devices,
                    "stage": stage,
                }
            )
            argv = overrides(mem, steps=2, stage=stage, devices=devices, batch=16, beta=BETA, extra=extra)
            jobs.append((compose(argv), "memory", 0))
        measured: dict[int, dict[str, Any]] = {}
        if smoke:  # one worker per process count
            for devices in (1, 2):
                chosen = [i for i, (tree, _, _) in enumerate(jobs) if tree["trainer"]["devices"] == devices]
                measured.update(zip(chosen, in_workers([jobs[i] for i in chosen], together=True)))
        ours = [measured.pop(0)] if smoke else []
        rows = vs_trl(ours, tiny, steps, repeats)
        done("vs TRL")
        for i in range(1, len(jobs)):
            rows.append({**labels[i], **(measured.get(i) or in_workers([jobs[i]])[0])})
            if i + 1 == len(jobs) or labels[i + 1]["part"] != labels[i]["part"]:
                done(labels[i]["part"])
    rows += [] if smoke else grpo_tiny([0, 1, 2])
    done("grpo_tiny")
    report(rows)
    write("grpo", rows, NOTES, args.out_dir)
    return rows


NOTES = {
    "vs TRL": "seconds: run.fit() / trainer.train() of the 40-step job, one process each (ZeRO-0 for ours)",
    "step split": "mean ms per step after the first; generation includes ZeRO-3's gather",
    "generation": "tokens/s over every rank; plain: the same generate call on the plain model",
    "memory": "peak RSS per rank above the RSS after imports; *_held_MB: weights on rank 0",
    "grpo_tiny": "seconds: whole-process wall time of python train.py experiment=grpo_tiny",
}


def report(rows: list[dict[str, Any]]) -> None:
    """One table per part, with that part's columns."""
    columns = {
        "vs TRL": ["setup", "seconds", "ours_over_trl", "reward_first10", "reward_last10", "peak_rss_MB"],
        "step split": [
            "setup", "ranks", "step_ms", "generation_ms", "reward_ms", "scoring_ms", "update_ms", "other_ms",
        ],
        "generation": [
            "setup", "ranks", "tokens_per_s", "gather_ms", "per_layer_tokens_per_s", "plain_tokens_per_s",
            "plain_same_tokens", "hf_sampling_tokens_per_s", "partitioned_share",
        ],
        "memory": ["setup", "ranks", "peak_minus_baseline_MB", "per_rank_peak_minus_baseline_MB",
                   "policy_held_MB", "reference_held_MB"],
        "grpo_tiny": ["setup", "seconds", "reward_step1", "reward_first10", "reward_last10", "first_step_at_0.8"],
    }  # fmt: skip
    split = [
        {**r, "setup": f"{r['setup']} (vs TRL job)"} for r in rows if r["part"] == "vs TRL" and "step_ms" in r
    ]
    for part, keys in columns.items():
        chosen = [r for r in rows if r["part"] == part] + (split if part == "step split" else [])
        print_table(f"GRPO: {part}", [{k: r.get(k) for k in keys} for r in chosen])


if __name__ == "__main__":
    main()
