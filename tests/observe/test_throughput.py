"""Throughput, model FLOPs, MFU and the step-time breakdown, in the logs of a real run."""

from __future__ import annotations

import functools

import pytest
import torch

from framework import Engine, Strategy
from framework.data.datasets import chars, synthetic
from framework.models import GPT, MLP, LMLoss
from framework.observe.throughput import FlopCount

from ..conftest import end_group


def step_records(engine, data, **fit):
    records = []

    class Keep:
        def on_event(self, event, state, control=None):
            if event.value == "step_end" and state.log_now:
                records.append(dict(state.logs))

    engine.fit(data, callbacks=[Keep()], **fit)
    return records


def test_a_transformer_reports_tokens_per_second_and_mfu_from_the_standard_formula():
    torch.manual_seed(0)
    model = GPT(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64)
    engine = Engine(model, LMLoss(), functools.partial(torch.optim.AdamW, lr=1e-3))
    data = chars(block_size=32, max_chars=50_000).train
    records = step_records(engine, data, epochs=1, batch_size=8, max_steps=6, log_freq=2, peak_tflops=1.0)
    n = sum(p.numel() for p in model.parameters())
    per_token = 6 * n + 12 * 2 * 64 * 32
    info = engine.state.info
    assert info.flops_per_step == per_token * 32 * 8 and info.flops_source.startswith("formula")
    last = records[-1]
    assert last["tokens_per_s"] == pytest.approx(last["samples_per_s"] * 32)
    seconds_per_step = 1 / (last["samples_per_s"] / 8)
    assert last["mfu"] == pytest.approx(info.flops_per_step / seconds_per_step / 1e12, rel=1e-6)
    phases = {k for k in last if k.startswith("time_")}
    assert phases == {"time_data_ms", "time_forward_ms", "time_backward_ms", "time_optimizer_ms"}
    assert sum(last[k] for k in phases) <= seconds_per_step * 1000 * 1.05


@pytest.mark.parametrize(
    "strategy",
    [{}, {"sharding": {"stage": 3}}, {"gradient_merge": {"k_steps": 2}}],
    ids=["zero0", "zero3", "accumulate2"],
)
def test_other_models_count_the_flops_of_their_first_optimizer_step(strategy):
    torch.manual_seed(0)
    engine = Engine(
        MLP(hidden=[32]),
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.SGD, lr=0.1),
        strategy=Strategy(**strategy),
    )
    records = step_records(
        engine, synthetic(num_samples=512).train, epochs=1, batch_size=16, max_steps=4, log_freq=2,
        peak_tflops=1.0,
    )  # fmt: skip
    # multiply-adds of 16 samples: forward through both Linear layers, backward to both weights
    # and to the first layer's output (the input needs no gradient)
    forward = 2 * 16 * (64 * 32 + 32 * 10)
    backward = 2 * 16 * (64 * 32 + 2 * 32 * 10)
    assert engine.state.info.flops_per_step == forward + backward
    assert engine.state.info.flops_source.startswith("counted")
    assert 0 < records[-1]["mfu"] < 1 and "tokens_per_s" not in records[-1]


def test_mfu_is_never_above_100_percent_and_needs_a_peak_on_a_cpu(capsys):
    """A CPU has no trustworthy peak (a probe read half the rate while other ranks shared the
    cores: MFU read 115-183 %): no MFU without trainer.peak_tflops, and a peak below what the run
    reached leaves MFU out, said once."""
    torch.manual_seed(0)
    data = synthetic(num_samples=512).train
    for peak, said in ((None, 0), (1e-9, 1)):
        engine = Engine(
            MLP(hidden=[32]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1)
        )
        records = step_records(
            engine, data, epochs=1, batch_size=16, max_steps=6, log_freq=2, peak_tflops=peak
        )
        assert len(records) == 3 and not any("mfu" in r for r in records)
        assert engine.state.info.flops_per_step > 0
        assert capsys.readouterr().err.count("warning: MFU left out: it would read") == said
        end_group()


def test_a_counted_step_trains_exactly_as_an_uncounted_one():
    """Counting FLOPs runs every operator as it is: the gradients of a SiLU MLP with attention
    (whose backward torch's FlopCounterMode decomposes, an ulp away) are the same bit for bit, and
    the count holds the matmuls and the CPU attention kernel, forward and backward."""
    torch.manual_seed(0)
    up, down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
    x = torch.randn(2, 4, 8, 16)  # (batch, heads, tokens, width)

    def grads():
        for p in (*up.parameters(), *down.parameters()):
            p.grad = None
        h = torch.nn.functional.silu(up(x))
        attended = torch.nn.functional.scaled_dot_product_attention(x, x, down(h), is_causal=True)
        attended.square().sum().backward()
        return [p.grad.clone() for p in (*up.parameters(), *down.parameters())]

    plain = grads()
    counter = FlopCount()
    with counter:
        counted = grads()
    assert all(torch.equal(a, b) for a, b in zip(plain, counted, strict=True))
    rows = 2 * 4 * 8
    matmuls = 3 * 2 * rows * 16 * 64 * 2 - 2 * rows * 16 * 64  # up, down: forward, both grads; no dx of up
    # 8x8 attention over 2x4 heads of width 16: QK^T and PV forward; backward recomputes QK^T
    # and makes the gradients of V, the scores, Q and K
    attention = (2 + 5) * 2 * (2 * 4) * 8 * 8 * 16
    assert counter.flops == matmuls + attention
