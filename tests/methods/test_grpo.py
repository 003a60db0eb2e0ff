"""GRPO (`framework.methods.grpo`): sampling that draws from the right distribution and does not
depend on the batch a completion shares, advantages and losses as TRL defines them, reward
functions that fail in one line, every option acting; and, end to end, a reward that rises, the
same run on ZeRO-3 x 2 and ZeRO-0 x 1, and the acceptance command's metrics."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from framework.errors import ConfigError
from framework.integrations import generation
from framework.methods import GRPO
from framework.methods.rollout import advantages, completion_mask, laid_out, seed_of
from framework.methods.scoring import Scored
from tests.conftest import run_train
from tests.helpers.tiny_chat import tiny_chat_tokenizer, tiny_llama, write_tiny_llama
from tests.helpers.tiny_prompts import write_prompts_jsonl

REWARD = "tests.helpers.tiny_prompts.meow_share"


# ----------------------------------------------------------------------------------- sampling


def test_each_completion_draws_from_the_sampling_distribution():
    """Gumbel-max behind greedy decoding: the frequencies of 4000 draws, each from its own
    generator, are the softmax of the temperature-scaled logits cut to the top k (3 sigma)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    temperature, top_k, draws = 0.7, 3, 4000
    processor = generation._processor(
        temperature, top_k, 1.0, [torch.Generator().manual_seed(i) for i in range(draws)]
    )
    picked = processor(None, logits.expand(draws, -1)).argmax(-1)
    want = torch.softmax(logits[0, :3] / temperature, -1)
    got = torch.bincount(picked, minlength=5).double() / draws
    assert got[3:].sum() == 0  # outside the top k: never
    sigma = (want * (1 - want) / draws).sqrt()
    assert ((got[:3] - want).abs() < 3 * sigma + 1e-3).all(), (got, want)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    processor = generation._processor(1.0, 0, 0.7, [torch.Generator().manual_seed(i) for i in range(2000)])
    picked = processor(None, logits.expand(2000, -1)).argmax(-1)
    assert set(picked.tolist()) == {0, 1}  # 0.5 + 0.3 reach 0.7; 0.15 and 0.05 are cut


def test_a_completion_does_not_depend_on_the_batch_it_shares():
    """The same prompt and generator give the same tokens alone, in a batch with other prompts
    (other padding) and with other rows beside it: completions are the same on any layout."""
    tok = tiny_chat_tokenizer()
    model = tiny_llama(tok, seed=0).eval()
    prompts = [[2, 10, 11], [2, 12, 13, 14, 15], [2, 16]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    seeds = [seed_of(0, 3, i) for i in range(3)]

    def sample(rows, row_seeds):
        generators = [torch.Generator().manual_seed(s) for s in row_seeds]
        return generation.sample(
            model, ids[rows], mask[rows], generators, 6, eos_token_id=None, pad_token_id=0
        )

    together = sample([0, 1, 2], seeds)
    for i in range(3):
        assert torch.equal(sample([i], [seeds[i]])[0], together[i])
    assert not torch.equal(together[0], sample([0], [seed_of(0, 4, 0)])[0])  # another step draws anew


def test_seeds_depend_on_the_run_seed_the_step_and_the_completion():
    seeds = {seed_of(s, t, i) for s in (0, 1) for t in (0, 1) for i in (0, 1)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert seed_of(0, 5, 9) == seed_of(0, 5, 9)


def test_a_completion_counts_through_its_first_end_of_sequence():
    completions = torch.tensor([[5, 6, 3, 0, 0], [5, 6, 7, 8, 9], [3, 0, 0, 0, 0]])
    mask, ended = completion_mask(completions, {3})
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert ended.tolist() == [True, False, True]


# ----------------------------------------------------------------------------------- advantages


def test_advantages_are_group_relative_as_trl_computes_them():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    group, same = advantages(rewards, 4, "group")
    std = torch.tensor([1.0, 0.0, 1.0, 0.0]).std()
    assert torch.allclose(group[:4], torch.tensor([0.5, -0.5, 0.5, -0.5], dtype=torch.float64) / (std + 1e-4))
    assert group[4:].tolist() == [0.0] * 4 and same.tolist() == [False] * 4 + [True] * 4
    none, _ = advantages(rewards, 4, "none")
    assert none[:4].tolist() == [0.5, -0.5, 0.5, -0.5]
    batch, _ = advantages(rewards, 4, "batch", everyone=rewards)
    assert torch.allclose(batch, none / (rewards.std() + 1e-4))


def test_a_completion_no_function_scores_counts_for_nothing():
    rewards = torch.tensor([1.0, math.nan, 0.0, 1.0], dtype=torch.float64)
    out, _ = advantages(rewards, 4, "none")
    assert out[1] == 0.0 and out[0] == pytest.approx(1 - 2 / 3)


# ----------------------------------------------------------------------------------- the loss


@pytest.fixture(scope="module")
def batch():
    """Two prompts x 2 completions of a tiny Llama, laid out for the update, with advantages."""
    tok = tiny_chat_tokenizer()
    model = tiny_llama(tok, seed=0)
    prompt = torch.tensor([[0, 2, 10], [2, 12, 13], [0, 2, 10], [2, 12, 13]])
    completions = torch.tensor([[14, 15, 3], [16, 3, 0], [17, 18, 19], [3, 0, 0]])
    mask, _ = completion_mask(completions, {3})
    out = laid_out(prompt, (prompt != 0).long(), completions, mask)
    out.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return SimpleNamespace(model=model, batch=out)


def fake_engine(model, accumulation=1, ranks=1):
    runtime = SimpleNamespace(strategy=SimpleNamespace(accumulation_steps=accumulation), dp_size=ranks)
    return SimpleNamespace(model=model, module=model, runtime=runtime)


def per_token(model, batch):
    """Plain torch: log p of each completion token (positions from the mask)."""
    out = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    )
    logp = torch.log_softmax(out.logits[:, batch.prompt_length - 1 : -1].float(), -1)
    return logp.gather(-1, batch.input_ids[:, batch.prompt_length :].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_each_loss_type_normalises_as_trl_does(batch, loss_type):
    """With the sampling policy the current one (ratio 1), the loss is -A per token, averaged as
    `loss_type` says."""
    method = GRPO(reward_funcs=[REWARD], loss_type=loss_type, max_completion_length=3)
    scored = Scored(
        [batch.batch],
        torch.zeros(4),
        tokens=float(batch.batch.completion_mask.sum()),
        reward_std=torch.zeros(()),
    )
    got = method.loss(fake_engine(batch.model), batch.batch, scored).item()
    mask = batch.batch.completion_mask.double()
    token_loss = -batch.batch.advantages.double().unsqueeze(1) * mask
    want = {
        "grpo": (token_loss.sum(-1) / mask.sum(-1)).mean(),
        "dr_grpo": token_loss.sum() / (4 * 3),
        "dapo": token_loss.sum() / mask.sum(),
    }[loss_type]
    assert got == pytest.approx(want.item(), abs=1e-6)
    logs = method.step_logs()
    assert {"entropy", "clip_ratio/region_mean"} <= set(logs) and logs["clip_ratio/region_mean"] == 0.0


def test_dapo_is_a_mean_over_the_global_batch_tokens_however_it_is_split(batch):
    """Two micro-batches of different token counts, each scaled by accumulation x ranks over the
    global count, averaged as DeepSpeed averages them: the loss of the batch taken whole."""
    method = GRPO(reward_funcs=[REWARD], loss_type="dapo")
    whole = batch.batch
    tokens = float(whole.completion_mask.sum())
    halves = []
    for rows in (slice(0, 1), slice(1, 4)):
        part = laid_out(
            whole.input_ids[rows, : whole.prompt_length],
            whole.attention_mask[rows, : whole.prompt_length],
            whole.input_ids[rows, whole.prompt_length :],
            whole.completion_mask[rows],
        )
        part.advantages = whole.advantages[rows]
        halves.append(part)
    scored = Scored(halves, torch.zeros(4), tokens=tokens, reward_std=torch.zeros(()))
    split = sum(method.loss(fake_engine(batch.model, accumulation=2), h, scored) for h in halves) / 2
    alone = method.loss(
        fake_engine(batch.model), whole, Scored([whole], torch.zeros(4), tokens, torch.zeros(()))
    )
    assert split.item() == pytest.approx(alone.item(), abs=1e-6)


def test_the_clipped_objective_and_the_kl(batch):
    """With an older policy's log-probabilities the ratio is clipped to [1 - epsilon,
    1 + epsilon_high] where the advantage's sign says, and beta adds TRL's k3 estimate of the KL."""
    method = GRPO(reward_funcs=[REWARD], loss_type="dapo", epsilon=0.1, epsilon_high=0.3, beta=0.5)
    b = batch.batch
    with torch.no_grad():
        logps = per_token(batch.model, b)
    b.old_logps = logps - torch.tensor([0.5, -0.5, 0.05, 0.0]).unsqueeze(1)  # ratios e^0.5, e^-0.5, ...
    b.ref_logps = logps + 0.2
    got = method.loss(
        fake_engine(batch.model),
        b,
        Scored([b], torch.zeros(4), float(b.completion_mask.sum()), torch.zeros(())),
    )
    ratio = torch.exp(logps - b.old_logps)
    a = b.advantages.unsqueeze(1)
    kl = torch.exp(torch.tensor(0.2)) - 0.2 - 1
    token = -torch.min(ratio * a, ratio.clamp(0.9, 1.3) * a) + 0.5 * kl
    mask = b.completion_mask.float()
    assert got.item() == pytest.approx(((token * mask).sum() / mask.sum()).item(), abs=1e-5)
    logs = method.step_logs()
    assert logs["kl"] == pytest.approx(kl.item(), abs=1e-6) and logs["clip_ratio/region_mean"] > 0
    b.old_logps = b.ref_logps = None


# ----------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "function, words",
    [
        ("tests.helpers.nowhere.reward", "reward function tests.helpers.nowhere.reward: cannot be imported"),
        ("tests.helpers.tiny_prompts.raises", "reward function raises raised KeyError: 'solution'"),
        ("tests.helpers.tiny_prompts.too_few", "reward function too_few returned 1 values for 2 completions"),
        (
            "tests.helpers.tiny_prompts.not_a_number",
            "reward function not_a_number returned 'good' for completion 0",
        ),
    ],
)
def test_a_bad_reward_function_is_one_line_naming_it(function, words):
    from framework.methods.rewards import reward_functions, score

    with pytest.raises(ConfigError) as err:
        functions, _ = reward_functions([function], None)
        score(functions, ["say hello ."] * 2, ["hello !", "meow"], {})
    assert words in str(err.value) and "\n" not in str(err.value)


def test_options_are_checked_and_the_batch_counts_completions():
    with pytest.raises(ConfigError, match=r"GRPO\(num_generations=1\): at least 2"):
        GRPO(reward_funcs=[REWARD], num_generations=1)
    with pytest.raises(ConfigError, match=r"GRPO\(loss_type='ppo'\)"):
        GRPO(reward_funcs=[REWARD], loss_type="ppo")
    with pytest.raises(ConfigError, match="give at least one reward function"):
        GRPO()
    with pytest.raises(ConfigError, match="2 weights for 1 reward functions"):
        GRPO(reward_funcs=[REWARD], reward_weights=[1.0, 2.0])
    assert GRPO(reward_funcs=[REWARD], num_generations=8).rows_per_batch(64) == 8
    with pytest.raises(ConfigError, match="counts completions: a multiple of num_generations=8"):
        GRPO(reward_funcs=[REWARD]).rows_per_batch(60)


def test_a_batch_size_that_is_not_a_multiple_of_g_stops_before_anything_starts(compose):
    from framework.recipe import validate

    cfg = compose(["experiment=grpo_tiny", "trainer.batch_size=60"])
    with pytest.raises(
        ConfigError, match="trainer.batch_size: counts completions: a multiple of num_generations=8"
    ):
        validate(cfg, world_size=2)


# ----------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    return SimpleNamespace(
        root=root,
        model_dir=write_tiny_llama(root / "llama"),
        prompts=write_prompts_jsonl(root / "prompts.jsonl"),
    )


def acceptance(t, *extra: str) -> list[str]:
    """Issue 47's command, the reward function the tests' own (by its import path)."""
    return [
        "model=hf_causal_lm",
        f"model.path={t.model_dir}",
        "data=hf_prompts",
        f"data.dataset.data_files={t.prompts}",
        "data.dataset.val_fraction=0",
        "+objective=grpo",
        "objective.num_generations=8",
        "objective.max_completion_length=8",
        "objective.temperature=1.0",
        "objective.beta=0.0",
        "objective.reward_funcs=[tests.helpers.tiny_prompts.cat_words]",
        "optimizer=adamw",
        "optimizer.lr=5e-3",
        "scheduler=constant",
        "metrics=none",
        "trainer.batch_size=64",
        "trainer.max_steps=40",
        "trainer.monitor=loss",
        *extra,
    ]


def steps(run_dir) -> list[dict]:
    return [
        r
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "step"
    ]


NAMES = {
    "reward",
    "reward_std",
    "rewards/cat_words/mean",
    "rewards/cat_words/std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "clip_ratio/region_mean",
    "entropy",
}


@pytest.mark.slow
def test_the_acceptance_command_learns_and_logs_trls_metrics(tiny, tmp_path):
    run = run_train(
        [*acceptance(tiny, "+strategy=zero3", "trainer.devices=2", "trainer.log_freq=1")], tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    records = steps(tmp_path)
    assert len(records) == 40 and all(NAMES <= set(r) for r in records)
    first = sum(r["reward"] for r in records[:10]) / 10
    last = sum(r["reward"] for r in records[-10:]) / 10
    assert last - first > 0.5, (first, last)  # a plain GRPO moves it by more than 0.8 in 40 steps
    samples = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert samples and {"step", "prompt", "completion", "rewards/cat_words"} <= set(samples[0])
    assert {s["step"] for s in samples} == {10, 20, 30, 40}  # every log_completions_every=10 steps


@pytest.mark.slow
def test_zero3_on_two_processes_and_zero0_on_one_train_the_same(tiny, tmp_path):
    """The same rewards and losses (1e-5) and the same exported weights (1e-5) after 3 SGD steps."""
    from framework.export import fp32_state_dict

    sgd = ["optimizer=sgd", "optimizer.lr=0.5", "trainer.max_steps=3", "trainer.log_freq=1"]
    two = run_train([*acceptance(tiny, *sgd), "+strategy=zero3", "trainer.devices=2"], tmp_path / "two")
    one = run_train(acceptance(tiny, *sgd), tmp_path / "one")
    assert two.returncode == 0 and one.returncode == 0, (two.stderr[-2000:], one.stderr[-2000:])
    for a, b in zip(steps(tmp_path / "two"), steps(tmp_path / "one"), strict=True):
        for key in ("loss", "reward", "reward_std", "completions/mean_length"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    w2, w1 = (
        fp32_state_dict(tmp_path / "two" / "checkpoints"),
        fp32_state_dict(tmp_path / "one" / "checkpoints"),
    )
    assert w2.keys() == w1.keys() and max((w2[k] - w1[k]).abs().max().item() for k in w1) < 1e-5
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny.model_dir).state_dict()
    assert max((w1[k] - base[k]).abs().max().item() for k in w1 if k in base) > 1e-4  # it trained


def test_several_updates_per_rollout_validation_and_a_lora_reference(tiny):
    """In one process with the Python API: num_iterations=2 takes two optimizer steps per rollout
    (the plan counts them; the second is clipped against the sampling policy), validation reports
    the validation prompts' reward, and with LoRA and beta > 0 the reference is the model with its
    adapters off (no copy is made)."""
    import functools

    from framework import Callback, Engine
    from framework.data.datasets.prompts import hf_prompts
    from framework.integrations.hf_models import causal_lm
    from framework.integrations.peft import AdapterConfig

    class Logged(Callback):
        records: list[dict] = []

        def on_step_end(self, state):
            if state.log_now:
                self.records.append(dict(state.logs))

    data = hf_prompts(str(tiny.prompts), tokenizer=str(tiny.model_dir), val_fraction=0.25)
    grpo = GRPO(reward_funcs=[REWARD], num_generations=4, max_completion_length=6, num_iterations=2, beta=0.1)
    engine = Engine(
        causal_lm(path=str(tiny.model_dir)),
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        train_step=grpo,
        adapter=AdapterConfig(r=4, dropout=0.0),
        callbacks=[Logged()],
    )
    with engine:
        history = engine.fit(
            data.train,
            data.valid,
            batch_size=8,
            max_steps=4,
            log_freq=1,
            collate_fn=data.collate_fn,
            progress=False,
        )
    assert not grpo.reference.is_copy  # the adapters switched off are the reference
    assert engine.state.global_step == 4 and len(Logged.records) == 2  # 2 rollouts x 2 updates
    assert all({"kl", "clip_ratio/region_mean", "reward"} <= set(r) for r in Logged.records)
    assert "val_reward" in history and "val_loss" in history
