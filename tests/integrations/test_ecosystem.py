"""Models and data from the ecosystem: Hugging Face transformers (ModelOutput, model(**batch),
labels=, save_pretrained), HF datasets from local files, a model that initialises through
`self.modules()` (torchvision/timm style), and a user's own config dir driving the CLI."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from framework import ConfigError, Engine, Strategy
from framework.backend.runtime import Runtime
from framework.data.datasets import chars
from framework.recipe import model as construct

from ..conftest import ROOT, end_group, fails_cleanly, run_cmd, subprocess_env

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
pytestmark = pytest.mark.timeout(300)

CONF = ROOT / "conf"


def tiny_gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


class Token(torch.utils.data.Dataset):
    """Dict rows, Hugging Face style: {"input_ids", "labels"} (the model shifts the labels)."""

    def __init__(self, n: int = 96, length: int = 16):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 128, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ------------------------------------------------------------------------------------- outputs, batches


@pytest.mark.parametrize("stage", [0, 3])
def test_a_hugging_face_model_trains_on_dict_batches_with_its_own_loss(stage):
    torch.manual_seed(0)
    model = tiny_gpt2()
    reference = [p.detach().clone() for p in model.parameters()]
    engine = Engine(
        model,
        "model",
        functools.partial(torch.optim.AdamW, lr=1e-2),
        strategy=Strategy(sharding={"stage": stage}),
    )
    history = engine.fit(Token(), valid_data=Token(40), epochs=3, batch_size=16)
    assert history["val_loss"][-1] < history["val_loss"][0]
    out = engine.predict(Token(40), batch_size=16)
    assert [type(o).__name__ for o in out] == ["CausalLMOutputWithCrossAttentions"] * 3
    assert [o.logits.shape[0] for o in out] == [16, 16, 8]  # padding trimmed from every field
    del reference


def test_evaluate_with_a_loss_reading_logits_matches_plain_torch():
    torch.manual_seed(0)
    data = chars(block_size=16, max_chars=20_000)
    engine = Engine(tiny_gpt2(), lm_loss, functools.partial(torch.optim.SGD, lr=0.1))
    result = engine.evaluate(
        data.valid, batch_size=7
    )  # 7 does not divide the data: padding in the last batch
    x = torch.stack([data.valid[i][0] for i in range(len(data.valid))])
    y = torch.stack([data.valid[i][1] for i in range(len(data.valid))])
    with torch.no_grad():
        logits = engine.module(x).logits
    per_sample = [float(lm_loss(logits[i : i + 1], y[i : i + 1])) for i in range(len(x))]
    assert result["loss"] == pytest.approx(sum(per_sample) / len(per_sample), rel=1e-5)


def test_a_loss_that_cannot_read_the_outputs_says_so():
    engine = Engine(tiny_gpt2(), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1))
    data = chars(block_size=16, max_chars=20_000)
    with pytest.raises(ConfigError, match="CrossEntropyLoss failed on the model's outputs .*loss=model"):
        engine.fit(data.train, epochs=1, batch_size=8, max_steps=1)


def test_accuracy_with_the_models_own_loss_scores_the_next_position_and_skips_ignored_labels():
    """A causal LM given labels= scores logits[t] against labels[t + 1]; label -100 never counts,
    for the framework's metric and for one that does not skip it itself."""
    from torchmetrics.classification import MulticlassAccuracy

    from framework.observe.metrics import Accuracy

    torch.manual_seed(0)
    model, rows = tiny_gpt2(), Token(32)
    with torch.no_grad():
        predicted = model(rows.ids).logits.argmax(-1)
    labels = torch.full_like(rows.ids, -100)
    labels[:, 1:] = predicted[:, :-1]  # what the model predicts for the next position
    labels[:, 5] = -100  # ignored (as a label it would be wrong)
    labels[:, 9] = (predicted[:, 8] + 1) % 128  # wrong and counted: 1 of the 14 counted per row
    data = [{"input_ids": i, "labels": y} for i, y in zip(rows.ids, labels)]
    metrics = {"accuracy": Accuracy(), "torchmetrics": MulticlassAccuracy(num_classes=128, average="micro")}
    result = Engine(model, "model", metrics=metrics).evaluate(data, batch_size=16)
    assert result["accuracy"] == pytest.approx(13 / 14) and result["torchmetrics"] == pytest.approx(13 / 14)


def test_predict_keeps_no_key_value_cache():
    """A cache per batch in the kept outputs would stay on the device: models are called with
    use_cache=False outside training."""
    torch.manual_seed(0)
    out = Engine(tiny_gpt2(), "model").predict(Token(24), batch_size=16)
    assert [list(o.keys()) for o in out] == [["logits"], ["logits"]]


# ------------------------------------------------------------------------------------- ZeRO-3 construction


class ModulesLoopInit(torch.nn.Module):
    """Initialises like torchvision / timm: a loop over self.modules() after building them."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3)
        self.head = torch.nn.Linear(8 * 6 * 6, 10)
        for m in self.modules():
            if isinstance(m, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, torch.nn.Linear):
                torch.nn.init.normal_(m.weight, 0, 0.01)
                torch.nn.init.constant_(m.bias, 0)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x.reshape(-1, 1, 8, 8))).flatten(1))


class TimmStyle(ModulesLoopInit):
    """timm's drop-path pattern: __init__ reads tensor values (impossible on the meta device)."""

    def __init__(self, depth: int = 3):
        rates = [x.item() for x in torch.linspace(0, 0.1, depth)]
        super().__init__()
        self.rates = rates


def initial_weights(node, stage: int, init: str = "auto") -> dict:
    runtime = Runtime(Strategy(sharding={"stage": stage, "init": init}))
    runtime.fix_layout(8)
    torch.manual_seed(0)
    model = construct.build_model(node, runtime)
    engine = Engine(
        model, torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1), runtime=runtime
    )
    engine.prepare("train", 8)
    weights = runtime.full_state_dict()
    end_group()
    return weights


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama", "ModulesLoopInit", "TimmStyle"])
def test_zero3_starts_from_the_same_weights_as_zero0(name):
    node = (
        OmegaConf.load(CONF / "model" / f"{name}.yaml")
        if name.startswith("hf_")
        else OmegaConf.create({"_target_": f"tests.integrations.test_ecosystem.{name}"})
    )
    zero0, zero3 = initial_weights(node, 0), initial_weights(node, 3)
    assert zero0.keys() == zero3.keys()
    for key in zero0:
        assert torch.equal(zero0[key], zero3[key]), key


class DataLoopInit(torch.nn.Module):
    """Initialises the old way: writes into `.data` (no torch.nn.init call to see)."""

    def __init__(self):
        super().__init__()
        self.hidden, self.head = torch.nn.Linear(64, 32), torch.nn.Linear(32, 10)
        for m in self.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.data.normal_(0, 0.01)
                m.bias.data.zero_()


@pytest.mark.parametrize("name", ["ModulesLoopInit", "DataLoopInit", "Wrapped"])
def test_a_model_initialised_by_hand_is_never_silently_mis_initialised_when_built_partitioned(name):
    # Wrapped: a transformers model inside a user's module, which transformers' own ZeRO-3 path
    # does not see; its initialisation writes through init functions kept from import time.
    node = OmegaConf.create({"_target_": f"tests.integrations.test_ecosystem.{name}"})
    with pytest.raises(
        ConfigError, match=r"initialises its weights after building its sub-modules .*init=whole"
    ):
        initial_weights(node, 3, init="partitioned")


def test_a_hugging_face_model_built_partitioned_gets_its_own_initialisation():
    """transformers' ZeRO-3 path: the init's distribution (not its random draws) is the model's."""
    weights = initial_weights(OmegaConf.load(CONF / "model" / "hf_gpt2.yaml"), 3, init="partitioned")
    assert weights["transformer.wte.weight"].std() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(weights["transformer.h.0.ln_1.weight"], torch.ones(128))


# ------------------------------------------------------------------------------------- HF export / fine-tune


@pytest.mark.slow
def test_hf_export_round_trips_and_fine_tuning_starts_from_the_directory(tmp_path):
    torch.manual_seed(0)
    engine = Engine(
        tiny_gpt2(),
        "model",
        functools.partial(torch.optim.AdamW, lr=1e-2),
        strategy=Strategy(sharding={"stage": 3}),
    )
    engine.fit(Token(), epochs=1, batch_size=16, save_dir=str(tmp_path / "ckpts"))
    end_group()
    out = tmp_path / "hf"
    cli = run_cmd([sys.executable, "-m", "framework.export", str(tmp_path / "ckpts"), str(out), "--hf"])
    assert cli.returncode == 0, cli.stderr
    assert (out / "config.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    batch = Token(8)[0]["input_ids"][None]
    trained = {
        k: v
        for k, v in __import__("framework.export", fromlist=["x"]).fp32_state_dict(tmp_path / "ckpts").items()
    }
    model = tiny_gpt2()
    model.load_state_dict(trained, strict=False)
    model.tie_weights()
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch).logits, model(batch).logits)
    # fine-tune the directory under ZeRO-3: the first loss is the directory's model's loss
    rows = Token(32)
    with torch.no_grad():
        expected = float(loaded(input_ids=rows.ids[:16], labels=rows.ids[:16]).loss)
    node = OmegaConf.create({"_target_": "framework.integrations.hf_models.causal_lm", "path": str(out)})
    runtime = Runtime(Strategy(sharding={"stage": 3, "init": "partitioned"}))
    runtime.fix_layout(16)
    model = construct.build_model(node, runtime)
    tuned = Engine(model, "model", functools.partial(torch.optim.SGD, lr=0.0), runtime=runtime)
    history = tuned.fit(rows, epochs=1, batch_size=16, shuffle=False, max_steps=1, log_freq=1)
    assert history["loss"][0] == pytest.approx(expected, rel=1e-5)


class Wrapped(torch.nn.Module):
    """A user's module around a transformers model (its weights are under `lm.`)."""

    def __init__(self):
        super().__init__()
        self.lm = tiny_gpt2()

    def forward(self, **batch):
        return self.lm(**batch)


def test_hf_export_of_a_wrapped_model_is_the_inner_models_directory(tmp_path, capsys):
    from framework.export import fp32_state_dict, save_hf_directory

    torch.manual_seed(0)
    engine = Engine(Wrapped(), "model", functools.partial(torch.optim.AdamW, lr=1e-2))
    engine.fit(Token(), epochs=1, batch_size=16, save_dir=str(tmp_path / "ckpts"))
    end_group()
    save_hf_directory(tmp_path / "ckpts", tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    model = Wrapped()
    model.load_state_dict(fp32_state_dict(tmp_path / "ckpts"), strict=False)
    model.lm.tie_weights()
    batch = Token(8)[0]["input_ids"][None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch).logits, model(input_ids=batch).logits)
    assert "not exported" not in capsys.readouterr().out  # nothing of the wrapper's own was left out


# ------------------------------------------------------------------------------------- your own config dir


MY_GPT2 = """\
_target_: transformers.GPT2LMHeadModel
config:
  _target_: transformers.GPT2Config
  vocab_size: 128
  n_positions: 64
  n_embd: 64
  n_layer: 2
  n_head: 2
  resid_pdrop: 0.0
  embd_pdrop: 0.0
  attn_pdrop: 0.0
  bos_token_id: 0
  eos_token_id: 0
"""
COMMON = [
    "model=my_gpt2", "data=chars", "data.dataset.max_chars=60000", "data.shuffle=false", "loss=lm",
    "metrics=none", "scheduler=constant", "trainer.max_steps=10", "trainer.log_freq=1",
    "trainer.batch_size=8", "trainer.valid_freq=100", "trainer.checkpoint.enabled=false",
]  # fmt: skip


def reference_losses(steps: int = 10) -> list[float]:
    """The same run as a plain PyTorch loop: same seed, same data order, fp32, no DeepSpeed."""
    from omegaconf import OmegaConf as OC

    from framework.recipe import seed_everything

    seed_everything(0)
    data = chars(block_size=64, max_chars=60000)
    node = OC.create(MY_GPT2)
    model = construct.instantiate(node)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.999), weight_decay=0.01)
    losses = []
    for step in range(steps):
        batch = [data.train[i] for i in range(step * 8, step * 8 + 8)]
        x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
        loss = lm_loss(model(x).logits, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


@pytest.fixture(scope="module")
def reference():
    return reference_losses()


@pytest.fixture
def project(tmp_path):
    """A user's project: only conf/ files, in a directory that is not the checkout."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "my_gpt2.yaml").write_text(MY_GPT2)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, nproc", [([], 1), (["+strategy=zero3"], 1), (["+strategy=zero3", "trainer.devices=2"], 2)]
)
@pytest.mark.slow
def test_the_cli_from_a_project_dir_matches_a_plain_pytorch_loop(project, reference, args, nproc):
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--config-dir",
        "conf",
        *COMMON,
        *args,
        f"hydra.run.dir={project / 'run'}",
    ]
    run = run_cmd_in(project, cmd)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (project / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "step"][:10]
    assert losses == pytest.approx(reference, rel=1e-5 if nproc == 1 else 1e-4)


def run_cmd_in(cwd: Path, cmd: list[str]):
    import subprocess

    return subprocess.run(cmd, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_a_project_config_dir_is_what_the_prechecks_see(project):
    """Options and keys of the user's own config dir are accepted; typos in them are one line."""
    base = [
        sys.executable,
        str(ROOT / "train.py"),
        "-cd",
        "conf",
        "+dry_run=true",
        f"hydra.run.dir={project / 'run'}",
    ]
    ok = run_cmd_in(project, [*base, "model=my_gpt2", "model.config.n_layer=3"])
    assert ok.returncode == 0, ok.stderr[-3000:]
    fails_cleanly(run_cmd_in(project, [*base, "model=my_gtp2"]), "unknown model 'my_gtp2'", "my_gpt2", "mlp")
    fails_cleanly(
        run_cmd_in(project, [*base, "model=my_gpt2", "model.confg.n_layer=3"]),
        "did you mean 'model.config'",
        "++model.confg",
    )
    search = run_cmd_in(
        project,
        [
            *base[:2],
            "+dry_run=true",
            f"hydra.searchpath=[file://{project / 'conf'}]",
            "model=my_gpt2",
            f"hydra.run.dir={project / 'run2'}",
        ],
    )
    assert search.returncode == 0, search.stderr[-3000:]


@pytest.mark.slow
def test_the_tiny_llama_experiment_runs_under_zero3_on_two_processes(tmp_path):
    run = run_cmd([sys.executable, str(ROOT / "train.py"), "experiment=hf_llama_chars", "trainer.max_steps=4",
                   "data.dataset.max_chars=60000", "trainer.log_freq=2", f"hydra.run.dir={tmp_path}"], timeout=240)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((tmp_path / "final_metrics.json").read_text())["step"] == 4
    # rank 0's console is also in the run dir's log file, with the model's true size
    config = construct.instantiate(OmegaConf.load(CONF / "model" / "hf_llama.yaml").config)
    config.vocab_size = 128
    with torch.device("meta"):
        size = sum(p.numel() for p in transformers.LlamaForCausalLM(config).parameters())
    line = f"model: {size:,} parameters, built whole"  # under a million: exactly
    assert line in run.stdout and line in (tmp_path / "train.log").read_text()


def test_hf_text_data_from_local_files(tmp_path):
    from framework.data.datasets.hf import hf_text

    notes = tmp_path / "notes.txt"
    notes.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(200)))
    splits = hf_text(str(notes), block_size=32)
    row = splits.train[0]
    assert set(row) == {"input_ids", "labels"} and row["input_ids"].shape == (32,)
    assert int(row["input_ids"].max()) < 256 and len(splits.valid) > 0
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    engine = Engine(
        transformers.GPT2LMHeadModel(config), "model", functools.partial(torch.optim.AdamW, lr=3e-3)
    )
    history = engine.fit(splits.train, valid_data=splits.valid, epochs=2, batch_size=16)
    assert history["val_loss"][-1] < history["val_loss"][0]
