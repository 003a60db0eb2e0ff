"""`Engine.autotune`: trials in the engine's own process, the choice returned and trained with."""

from __future__ import annotations

import functools

import pytest
import torch

from framework import ConfigError, Engine, Strategy
from framework.data.datasets import chars
from framework.models import GPT, LMLoss
from framework.plan.tune import Layout


def _engine() -> Engine:
    torch.manual_seed(0)
    return Engine(GPT(n_layer=2), LMLoss(), functools.partial(torch.optim.AdamW, lr=1e-3))


@pytest.mark.slow
def test_engine_autotune_returns_the_fastest_that_fits_and_trains_with_it(capsys):
    """One process: the trials run in it one after another (each engine built and closed). Within a
    budget everything fits: the simplest layout is tried and the rest skipped; exhaustively, every
    layout is tried and the choice is the fastest (the simplest within 3 %). The engine trains with it."""
    data = chars(block_size=32, max_chars=50_000).train
    engine = _engine()
    strategy, table = engine.autotune(
        data, batch_size=8, memory_gb=8, space=["stage", "micro_batch"], trial_steps=4
    )
    assert Layout.of(strategy) == Layout() and len(table) == 4 * 3
    assert [r["status"] for r in table].count("ok") == 1
    assert all(r["status"].startswith("skipped: saves more memory than ZeRO-0") for r in table[1:])
    engine.close()

    engine = _engine()
    strategy, table = engine.autotune(data, 8, 8, space=["micro_batch"], trial_steps=4, exhaustive=True)
    assert isinstance(strategy, Strategy) and engine.strategy is strategy
    assert len(table) == 3 and all(row["status"] == "ok" and row["fits"] for row in table)
    row = next(r for r in table if r["overrides"] == Layout.of(strategy).overrides())
    assert row["samples_per_s"] >= 0.97 * max(r["samples_per_s"] for r in table)
    assert all(0 < r["peak_gb"] < 8 for r in table)
    out = capsys.readouterr().out
    assert "est GB" in out and f"autotune: {row['layout']}" in out
    history = engine.fit(data, batch_size=8, max_steps=3, epochs=1, progress=False)
    assert engine.state.global_step == 3 and history["loss"]
    with pytest.raises(ConfigError, match="autotune before the engine is prepared"):
        engine.autotune(data, batch_size=8)
    engine.close()


def test_a_budget_nothing_fits_stops_before_any_trial():
    """Every layout's model states alone are over 1 MB: one line, no trial run."""
    engine = _engine()
    with pytest.raises(
        ConfigError, match=r"^autotune: no layout fits 0.001 GB per rank .*smallest estimated need"
    ):
        engine.autotune(chars(block_size=32, max_chars=20_000).train, batch_size=8, memory_gb=0.001)
    assert not engine.runtime.ready
    engine.close()
