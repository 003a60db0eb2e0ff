"""`+autotune=search` end to end, the layout chosen fits the budget, is as
fast as the best that fits (by the search's own side-by-side measurements), and trains what the same layout given by hand
trains; a budget nothing fits and a plan on paper are one line and a table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, fails_cleanly, run_cmd, run_train

# A GPT whose model states outweigh its activations (25 M parameters, 16-token windows), so the
# ZeRO stages differ in memory by more than a process's noise; 2 ranks, a global batch of 4.
GPT_RUN = [
    "model=gpt", "data=chars", "loss=lm", "metrics=none", "trainer.devices=2", "trainer.batch_size=4",
    "model.n_embd=512", "model.n_layer=8", "model.block_size=16", "data.dataset.block_size=16",
    "data.dataset.max_chars=200000", "trainer.checkpoint.enabled=false", "trainer.log_freq=1",
    "trainer.max_steps=5", "scheduler=constant",
]  # fmt: skip
SEARCH = ["+autotune=search", "autotune.trial_steps=5", "autotune.warmup_steps=2", "autotune.margin=1.0"]


def multirun(args: list[str], sweep_dir: Path, timeout: float = 600):
    run = run_cmd(
        [sys.executable, str(ROOT / "train.py"), "-m", *args, f"hydra.sweep.dir={sweep_dir}"], timeout
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _stage(overrides: list[str]) -> int:
    return int(next(o for o in overrides if o.startswith("strategy.sharding.stage=")).split("=")[1])


def losses(run_dir: Path) -> list[float]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in rows if r["kind"] == "step"]


@pytest.mark.slow
def test_the_chosen_layout_fits_is_as_fast_as_the_best_and_trains_the_same(tmp_path):
    # The budget, by hand: a third of the way from ZeRO-1's peak to ZeRO-0's (AdamW's states, split
    # across the 2 ranks by ZeRO-1, are ~100 MB of this model; ZeRO-0's peak varies the more from
    # run to run), each measured in its own worker group.
    multirun(
        [*GPT_RUN, *SEARCH, "autotune.space=[]", "autotune.only=true", "strategy.sharding.stage=0,1"],
        tmp_path / "grid",
    )
    grid = {}
    for job in range(2):
        (trial,) = json.loads((tmp_path / "grid" / str(job) / "autotune.json").read_text())["trials"]
        assert trial["status"] == "ok" and not (tmp_path / "grid" / str(job) / "metrics.jsonl").exists()
        grid[job] = trial["peak_gb"]
    assert grid[1] < grid[0] - 0.05, grid
    budget = round(grid[1] + (grid[0] - grid[1]) / 3, 4)

    run = run_train(
        [*GPT_RUN, *SEARCH, "autotune.space=[stage]", f"autotune.memory_gb={budget}"],
        tmp_path / "tuned",
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "tuned" / "autotune.json").read_text())
    chosen = result["chosen"]
    assert result["budget_gb"] == budget and chosen["peak_gb"] < budget
    stage = _stage(chosen["overrides"])
    # The fastest of those that fit, by the search's own measurements (taken side by side in one
    # process group), within its 3 % tie rule; times from other runs are not compared (noise).
    own = [t["samples_per_s"] for t in result["trials"] if t["fits"] and t.get("samples_per_s")]
    assert chosen["samples_per_s"] >= 0.97 * max(own) - 0.01, result["trials"]  # rounded to 0.01
    assert stage != 0 and not next(t for t in result["trials"] if _stage(t["overrides"]) == 0)["fits"]
    assert len(result["trials"]) == 4 and all(
        set(t) >= {"estimated_gb", "fits", "status"} for t in result["trials"]
    )
    assert "layout" in run.stdout and f"pin it with: {' '.join(chosen['overrides'])}" in run.stdout
    saved = yaml.safe_load((tmp_path / "tuned" / "config.yaml").read_text())
    assert saved["strategy"]["sharding"]["stage"] == stage  # the run records the layout it trained with

    # What it trained: the same as the chosen layout given by hand (layout invariance, that ZeRO-0
    # trains the same, is tested on its own).
    hand = run_train([*GPT_RUN, *chosen["overrides"]], tmp_path / "hand")
    assert hand.returncode == 0, hand.stderr[-3000:]
    tuned = losses(tmp_path / "tuned")
    assert len(tuned) == 5 and tuned == pytest.approx(losses(tmp_path / "hand"), abs=1e-6)


@pytest.mark.slow
def test_an_impossible_budget_is_one_line_and_a_paper_plan_trains_nothing(tmp_path):
    run = run_train([*GPT_RUN, "+autotune=search", "autotune.memory_gb=0.001"], tmp_path / "tiny")
    fails_cleanly(run, "autotune: no layout fits 0.001 GB per rank", "smallest estimated need", "more ranks")
    result = json.loads((tmp_path / "tiny" / "autotune.json").read_text())
    assert result["chosen"] is None and all(t["status"].startswith("pruned") for t in result["trials"])

    paper = [
        "model=hf_llama", "+autotune=search", "autotune.only=true", "autotune.target.devices=64",
        "autotune.target.memory_gb=80", "strategy.amp.enable=true",
    ]  # fmt: skip
    run = run_train(paper, tmp_path / "paper")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "autotune on paper: LlamaForCausalLM" in run.stdout and "fits on paper" in run.stdout
    assert not (tmp_path / "paper" / "metrics.jsonl").exists()
    result = json.loads((tmp_path / "paper" / "autotune.json").read_text())
    assert result["plan"] == "paper" and result["devices"] == 64 and result["chosen"]["overrides"]

    run = run_train(paper[:-3] + ["autotune.only=false", "autotune.target.devices=64"], tmp_path / "not_only")
    fails_cleanly(run, "autotune.target plans for a cluster that is not here")


@pytest.mark.slow
def test_a_sweep_tunes_once_with_the_cache_and_a_restarted_job_reuses_its_choice(tmp_path):
    """Two jobs of a learning-rate sweep: the first searches, the second takes its result; the
    first job started again in its own dir takes the layout its autotune.json chose."""
    args = [
        "+autotune=search",
        "autotune.cache=true",
        "autotune.space=[]",
        "autotune.only=true",
        "trainer.max_steps=2",
    ]
    run = multirun([*args, "optimizer.lr=1e-3,2e-3"], tmp_path / "sweep")
    assert run.stdout.count("layout(s) of a global batch") == 1 and "from autotune.cache" in run.stdout
    first, second = (
        json.loads((tmp_path / "sweep" / job / "autotune.json").read_text()) for job in ("0", "1")
    )
    assert first == second and first["chosen"]["overrides"][0] == "strategy.sharding.stage=0"
    again = run_train([*args, "optimizer.lr=1e-3"], tmp_path / "sweep" / "0")
    assert again.returncode == 0 and "from this run dir's autotune.json" in again.stdout
