"""DPO (`framework.methods.dpo`) against TRL's `DPOTrainer` on a tiny Llama and 8 pairs, its
reference under adapters, the pairs data, and the same training on every layout."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

from framework.data.datasets.preference import hf_preference
from framework.data.streams import Reader
from framework.errors import ConfigError
from framework.methods import DPO, method_class
from framework.methods.pairs import PAIR_METRICS
from framework.methods.precompute import with_reference_logps
from tests.conftest import ROOT, run_layout_script
from tests.helpers.tiny_chat import tiny_chat_tokenizer, tiny_llama, write_tiny_llama
from tests.helpers.tiny_pairs import PAIRS, write_pairs_jsonl


def _as_step_host(model):
    """What a training step uses of the Engine (`framework.engine.steps`'s documented subset), on
    one process without DeepSpeed (the layout script runs the real runtime's `frozen`)."""
    runtime = SimpleNamespace(frozen=lambda reference: reference.requires_grad_(False).eval())
    return SimpleNamespace(model=model, module=model, output_key=None, runtime=runtime)


def attached(method, model):
    """`method` as an Engine taking it sets it up (`Method.attach`), without DeepSpeed."""
    method.attach(_as_step_host(model))
    return method


def _messages(value, role):
    return [{"role": role, "content": value}] if isinstance(value, str) else value


@pytest.fixture(scope="module")
def trl_batch(tmp_path_factory):
    """TRL's DPOTrainer over the 8 pairs (policy and reference two different tiny Llamas): its
    first batch, its loss and reward metrics, and our pairs data over the same file."""
    datasets = pytest.importorskip("datasets", reason="needs the hf extra: pip install -e '.[hf]'")
    trl = pytest.importorskip("trl", reason="needs the bench extra: pip install -e '.[bench]'")
    tmp = tmp_path_factory.mktemp("dpo")
    tok = tiny_chat_tokenizer()
    policy, reference = tiny_llama(tok, seed=0), tiny_llama(tok, seed=1)
    rows = [{k: _messages(p[k], "user" if k == "prompt" else "assistant") for k in p} for p in PAIRS]
    args = trl.DPOConfig(
        output_dir=str(tmp / "trl"), beta=0.1, per_device_train_batch_size=8, report_to=[], use_cpu=True
    )
    trainer = trl.DPOTrainer(
        model=policy, ref_model=reference, args=args, train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
    )  # fmt: skip
    batch = next(iter(trainer.get_train_dataloader()))
    policy.train()
    loss = trainer.compute_loss(trainer.model, batch).item()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    trainer.loss_types = ["ipo"]  # the same trainer, its loss switched to IPO
    ipo_loss = trainer.compute_loss(trainer.model, batch).item()
    model_dir = write_tiny_llama(tmp / "llama")
    pairs_file = write_pairs_jsonl(tmp / "pairs.jsonl", rows)  # as TRL gets them: chat messages
    ours = hf_preference(str(pairs_file), tokenizer=str(model_dir), val_fraction=0)
    return SimpleNamespace(
        policy=policy,
        reference=reference,
        batch=batch,
        loss=loss,
        ipo_loss=ipo_loss,
        metrics=metrics,
        ours=ours,
        pairs_file=str(pairs_file),
    )


def _ours_from_trl(batch):
    """TRL's batch (chosen rows, then rejected; completion_mask) as our pairs batch."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    out = {}
    for side, part in zip(("chosen", "rejected"), range(2)):
        rows = slice(part * 8, (part + 1) * 8)
        out[f"{side}_input_ids"] = batch["input_ids"][rows]
        out[f"{side}_attention_mask"] = batch["attention_mask"][rows]
        out[f"{side}_labels"] = labels[rows]
    return out


def test_pairs_data_renders_as_trl_does(trl_batch):
    """Our rows hold TRL's tokens for each pair (its loader shuffles them), labels on exactly its
    completion tokens."""
    batch, theirs, ours = trl_batch.batch, [], []
    for i in range(8):
        pair = []
        for offset in (0, 8):
            keep = batch["attention_mask"][i + offset].bool()
            pair += [
                batch["input_ids"][i + offset][keep].tolist(),
                batch["completion_mask"][i + offset][keep].tolist(),
            ]
        theirs.append(pair)
        row = trl_batch.ours.train[i]
        ours.append(
            [row[f"{side}_{key}"].tolist() if key == "input_ids" else (row[f"{side}_labels"] != -100).long().tolist()
             for side in ("chosen", "rejected") for key in ("input_ids", "labels")]
        )  # fmt: skip
    assert sorted(ours) == sorted(theirs)


def test_dpo_loss_and_metrics_equal_trl(trl_batch):
    """A policy that differs from the reference: TRL's loss and every pair metric TRL logs under
    the same name (rewards/*, logps/*, logits/*), to 1e-5."""
    dpo = DPO(beta=0.1, reference=copy.deepcopy(trl_batch.reference))
    loss = dpo(_as_step_host(trl_batch.policy), _ours_from_trl(trl_batch.batch))
    logs = dpo.step_logs()
    assert loss.item() == pytest.approx(trl_batch.loss, abs=1e-5)
    assert set(logs) == set(PAIR_METRICS) and set(PAIR_METRICS) <= set(trl_batch.metrics)
    for name in PAIR_METRICS:
        assert logs[name] == pytest.approx(trl_batch.metrics[name], abs=1e-5, rel=1e-6), name
    assert abs(loss.item() - math.log(2)) > 1e-3  # the policy really differs


def test_validation_rewards_are_their_own_and_a_checkpointed_window_reads_the_same(trl_batch):
    """eval_step feeds a meter of its own (eval_logs: TRL's eval rewards), apart from the training
    window; the window a checkpoint keeps (step_state) reads the same in a new run, and two saved
    ranks' windows given to one rank (another number of ranks) read as both together."""
    host, batch = _as_step_host(trl_batch.policy), _ours_from_trl(trl_batch.batch)
    dpo = DPO(beta=0.1, reference=copy.deepcopy(trl_batch.reference))
    dpo.eval_step(host, batch)
    assert dpo.step_logs() == {}  # validation pairs are not training's
    assert dpo.eval_logs()["rewards/margins"] == pytest.approx(trl_batch.metrics["rewards/margins"], abs=1e-5)
    assert dpo.eval_logs() == {}  # read once

    halves = [{k: v[:3] for k, v in batch.items()}, {k: v[3:] for k, v in batch.items()}]
    ranks = [DPO(beta=0.1, reference=copy.deepcopy(trl_batch.reference)) for _ in halves]
    for rank, half in zip(ranks, halves):
        rank(host, half)
        dpo(host, half)
    one, two = [dpo.step_state()], [rank.step_state() for rank in ranks]
    want = dpo.step_logs()  # what the uninterrupted run logs
    for states in (one, two):
        resumed = DPO(beta=0.1, reference=copy.deepcopy(trl_batch.reference))
        resumed.load_step_state(states)
        assert resumed.step_logs() == pytest.approx(want, abs=1e-12)
    resumed.load_step_state([])  # a rank given no window (another layout's other ranks)
    assert resumed.step_logs() == {}


def test_ipo_loss_equals_trl(trl_batch):
    """IPO: log-probabilities averaged over the answer tokens, TRL's squared loss."""
    dpo = DPO(beta=0.1, loss_type="ipo", reference=copy.deepcopy(trl_batch.reference))
    loss = dpo(_as_step_host(trl_batch.policy), _ours_from_trl(trl_batch.batch))
    assert loss.item() == pytest.approx(trl_batch.ipo_loss, abs=1e-5)


def test_policy_equal_to_reference_gives_ln2(trl_batch):
    """An untrained policy equal to its reference: ln 2, every reward 0, on our own pairs data."""
    batch = trl_batch.ours.collate_fn([trl_batch.ours.train[i] for i in range(8)])
    dpo = DPO(beta=0.1, reference=copy.deepcopy(trl_batch.policy))
    assert dpo(_as_step_host(trl_batch.policy), batch).item() == pytest.approx(math.log(2), abs=1e-6)
    assert dpo.step_logs()["rewards/margins"] == pytest.approx(0.0, abs=1e-7)


def test_peft_reference_is_the_model_with_adapters_disabled(trl_batch):
    """Under LoRA no copy is kept: fresh adapters give ln 2; trained ones the loss against the base."""
    peft = pytest.importorskip("peft", reason="needs the hf extra: pip install -e '.[hf]'")
    base = tiny_llama(tiny_chat_tokenizer(), seed=2)
    model = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    batch = trl_batch.ours.collate_fn([trl_batch.ours.train[i] for i in range(8)])
    dpo = attached(DPO(beta=0.1), model)
    assert not dpo.reference.is_copy
    assert dpo(_as_step_host(model), batch).item() == pytest.approx(math.log(2), abs=1e-6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    against_base = DPO(beta=0.1, reference=base)(_as_step_host(model), batch).item()
    assert dpo(_as_step_host(model), batch).item() == pytest.approx(against_base, abs=1e-6)
    assert abs(against_base - math.log(2)) > 1e-3


def test_ipo_and_options_are_checked():
    """Errors name the API's parameter; `ConfigError.at` words them with the config key."""
    with pytest.raises(ConfigError, match=r"DPO\(loss_type='kto'\): one of sigmoid, ipo") as err:
        DPO(loss_type="kto")
    assert err.value.at("objective") == "objective.loss_type=kto: one of sigmoid, ipo"
    with pytest.raises(ConfigError, match=r"DPO\(beta=0\)"):
        DPO(beta=0)
    with pytest.raises(ConfigError, match="did you mean beta"):
        DPO(betta=0.2)
    with pytest.raises(ConfigError, match="no training method called 'kto'"):
        method_class("kto")


def test_a_frozen_copy_is_made_when_the_engine_takes_the_method():
    """From Python as from the CLI: DPO() without a reference copies the model it is attached to
    (before DeepSpeed); with precompute_reference, or for a peft model, no copy is made."""
    model = torch.nn.Linear(2, 2)
    assert attached(DPO(), model).reference.is_copy
    assert attached(DPO(), model).reference.module is not model
    assert not attached(DPO(precompute_reference=True), model).reference.is_copy


def test_a_pair_cut_away_is_dropped_and_counted(tmp_path, capsys):
    model_dir = write_tiny_llama(tmp_path / "llama")
    long_prompt = {"prompt": " ".join(["what do cats say ?"] * 12), "chosen": "meow .", "rejected": "one ."}
    data = write_pairs_jsonl(tmp_path / "pairs.jsonl", [*PAIRS[:3], long_prompt])
    splits = hf_preference(str(data), tokenizer=str(model_dir), max_length=40, val_fraction=0)
    assert len(splits.train) == 3
    assert "data: 1 of 4 pairs dropped" in capsys.readouterr().out


def test_a_pairs_stream_gives_the_map_style_rows(trl_batch, tmp_path):
    model_dir = write_tiny_llama(tmp_path / "llama")
    streamed = hf_preference(trl_batch.pairs_file, tokenizer=str(model_dir), streaming=True, shards=1)
    got = [item for item, _, _ in Reader(streamed.train, 0, 1, 0, {})]
    assert streamed.valid is None and len(got) == len(trl_batch.ours.train) == 8
    for item, row in zip(got, trl_batch.ours.train):
        assert {k: v.tolist() for k, v in item.items()} == {k: v.tolist() for k, v in row.items()}
    with pytest.raises(ConfigError, match="not a stream"):
        with_reference_logps(None, streamed.train, 8, streamed.collate_fn)


@pytest.mark.slow
def test_dpo_trains_the_same_weights_on_every_layout(tmp_path):
    """2 ranks x ZeRO 0 / 3 x accumulation 1 / 2, the reference a frozen copy (under ZeRO-3
    partitioned), stored log-probabilities or (LoRA) the model with adapters disabled: plain
    torch's weights, loss and reward metrics after two SGD steps on one process (fp32, 1e-5); a
    model ZeRO-3 built partitioned is not copied (one line)."""
    script_results = run_layout_script(tmp_path, ranks=2, timeout=240, script="dpo_invariance.py")
    assert all(moved > 1e-3 for r in script_results for moved in r["moved"].values())
    assert len(script_results[0]["errors"]) == 5
    assert all(r["reference_share"] < 0.6 for r in script_results)  # the ZeRO-3 copy is partitioned
    assert all("precompute_reference=True" in r["refused"] for r in script_results)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 2 and all(key in r for r in steps for key in PAIR_METRICS), steps
    assert steps[1]["rewards/margins"] != 0.0  # TRL's names, in the run's metrics file


def test_the_shipped_pairs_are_the_helpers():
    """examples/tiny_chat/pairs.jsonl (what experiment=dpo_lora trains on) cannot drift."""
    shipped = (ROOT / "examples" / "tiny_chat" / "pairs.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in shipped] == PAIRS
