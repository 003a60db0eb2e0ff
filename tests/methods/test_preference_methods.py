"""SimPO and ORPO (`framework.methods.simpo`, `.orpo`): their losses are the papers' formulas on a
tiny Llama and 8 pairs, their gradients those of plain autograd on the formula, ORPO's NLL a mean
over the global batch's chosen tokens however the batch is split, and their metrics TRL's names."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from framework.data.datasets.preference import PairCollator, PairEncoder
from framework.engine.items import counted_windows
from framework.methods import ORPO, SFT, Method, SimPO, method_class, registered
from framework.methods.pairs import PAIR_METRICS
from framework.plan.run_plan import Mesh
from tests.helpers.tiny_chat import tiny_chat_tokenizer, tiny_llama
from tests.helpers.tiny_pairs import PAIRS


@pytest.fixture(scope="module")
def pairs():
    """The 8 pairs as one batch, a tiny Llama, and each answer's (sum of log-probs, tokens)."""
    tok = tiny_chat_tokenizer()
    encoder = PairEncoder(tok, 256, ("prompt", "chosen", "rejected"))
    rows = [encoder.encode(p, f"pair {i}") for i, p in enumerate(PAIRS)]
    batch = PairCollator(tok.pad_token_id)(rows)
    model = tiny_llama(tok, seed=0)
    return SimpleNamespace(batch=batch, model=model, rows=rows, collate=PairCollator(tok.pad_token_id))


def host(model):
    return SimpleNamespace(model=model, module=model, output_key=None)


def answer_logps(model, batch, side):
    """Plain torch: per row, (sum of log p of the answer's tokens, their count)."""
    logits = model(
        input_ids=batch[f"{side}_input_ids"], attention_mask=batch[f"{side}_attention_mask"]
    ).logits
    labels = batch[f"{side}_labels"][:, 1:]
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    mask = labels != -100
    picked = logp.gather(2, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1), mask.sum(-1)


def simpo_formula(model, batch, beta, gamma):
    (c, nc), (r, nr) = answer_logps(model, batch, "chosen"), answer_logps(model, batch, "rejected")
    return (-F.logsigmoid(beta * (c / nc - r / nr) - gamma)).mean()


def orpo_formula(model, batch, beta):
    (c, nc), (r, nr) = answer_logps(model, batch, "chosen"), answer_logps(model, batch, "rejected")
    avg_c, avg_r = c / nc, r / nr
    log_odds = (avg_c - avg_r) - (torch.log(1 - torch.exp(avg_c)) - torch.log(1 - torch.exp(avg_r)))
    return -c.sum() / nc.sum() - beta * F.logsigmoid(log_odds).mean()


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize(
    "method, formula",
    [
        (SimPO(beta=2.0, gamma=0.5), lambda m, b: simpo_formula(m, b, 2.0, 0.5)),
        (ORPO(beta=0.1), lambda m, b: orpo_formula(m, b, 0.1)),
    ],
)
def test_the_loss_and_its_gradient_are_the_formulas(pairs, method, formula):
    model = pairs.model
    model.zero_grad()
    want = formula(model, pairs.batch)
    want.backward()
    want_grads = grads(model).clone()
    model.zero_grad()
    got = method(host(model), pairs.batch)
    got.backward()
    assert got.item() == pytest.approx(want.item(), abs=1e-6)
    assert torch.allclose(grads(model), want_grads, atol=1e-6)
    logs = method.step_logs()
    assert set(PAIR_METRICS) <= set(logs)
    assert 0.0 <= logs["rewards/accuracies"] <= 1.0


def test_orpo_nll_is_a_mean_over_the_global_batch_tokens(pairs):
    """Two micro-batches of 4 pairs, weighted as the framework weighs them (`Method.items`) and
    averaged as DeepSpeed averages accumulation steps: the loss of the whole batch."""
    model, orpo = pairs.model, ORPO(beta=0.1)
    halves = [pairs.collate(pairs.rows[:4]), pairs.collate(pairs.rows[4:])]
    assert orpo.items(halves[0]) != orpo.items(halves[1])  # the halves count different tokens
    (weights,) = counted_windows([halves], orpo.items, Mesh(world_size=1, rank=0))
    split = sum(orpo(host(model), half, weights[i]) for i, half in enumerate(halves)) / 2
    assert split.item() == pytest.approx(orpo_formula(model, pairs.batch, 0.1).item(), abs=1e-6)
    logs = orpo.step_logs()
    assert {"nll_loss", "log_odds_ratio", "log_odds_chosen"} <= set(logs)


def test_simpo_rewards_are_beta_times_the_mean_log_probability(pairs):
    c, nc = answer_logps(pairs.model, pairs.batch, "chosen")
    simpo = SimPO(beta=2.0, gamma=0.5)
    simpo(host(pairs.model), pairs.batch)
    assert simpo.step_logs()["rewards/chosen"] == pytest.approx((2.0 * c / nc).mean().item(), abs=1e-5)


def test_every_method_is_registered_by_name_and_found_by_import_path():
    assert {"sft", "dpo", "simpo", "orpo"} <= set(registered())
    assert method_class("simpo") is SimPO and method_class("framework.methods.orpo.ORPO") is ORPO
    assert all(issubclass(cls, Method) and cls.name == name for name, cls in registered().items())
    assert math.isclose(SimPO().config.beta, 2.0) and SimPO().config.gamma == 0.5
    assert ORPO().config.beta == 0.1 and SFT().config is not None
