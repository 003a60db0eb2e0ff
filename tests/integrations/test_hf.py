"""A Hugging Face user's first hour: padded batches under recompute, the `hf` extra, tokenizers
that belong to the model, text classification from files, and the numbers the run reports."""

from __future__ import annotations

import ast
import functools
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from framework import Engine, Strategy

from ..conftest import ROOT, end_group, run_cmd, run_train

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
pytestmark = pytest.mark.timeout(300)


def tiny_llama(vocab_size: int = 64) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def padded_rows(n: int = 16, length: int = 16) -> list[dict[str, torch.Tensor]]:
    """Rows of a padded batch: every other row ends in padding (attention_mask 0, label -100)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (n, length), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, length * 2 // 3 :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels)]


# ------------------------------------------------------------------------------------- recompute


@pytest.mark.parametrize("stage", [0, 3])
def test_recompute_on_a_padded_batch_trains_as_without_it(stage, capsys):
    """The model's key/value cache would grow again in the recomputation (keys twice the mask's
    length in backward): under recompute it is off, said in one line, and the losses are those of
    the same run without recompute."""
    losses = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        strategy = Strategy(sharding={"stage": stage}, recompute={"enable": recompute})
        engine = Engine(tiny_llama(), "model", functools.partial(torch.optim.SGD, lr=0.5), strategy=strategy)
        history = engine.fit(padded_rows(), epochs=2, batch_size=8, shuffle=False, log_freq=1)
        losses[recompute] = history["loss"]
        end_group()
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert losses[True][-1] < losses[True][0]
    out = capsys.readouterr().out
    assert out.count("recompute: use_cache turned off for LlamaForCausalLM") == 1


# ------------------------------------------------------------------------------------- the hf extra


def _readme_extras() -> set[str]:
    """The extras the README's set-up block installs (`pip install -e ".[test]"` and the like)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Set up", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return {
        extra for group in re.findall(r'pip install -e "\.\[([^\]]+)\]"', block) for extra in group.split(",")
    }


def _closure(requirements: list[str]) -> set[str]:
    """Every distribution those requirements bring, by following the installed distributions'
    own requirements (markers evaluated, each package's requested extras included)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        extras = {("", name)} | {(e, name) for e in req.extras}
        if all(f"{name}[{e}]" in seen for e, _ in extras):
            continue
        seen.update(f"{name}[{e}]" for e, _ in extras)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        for e, _ in extras:
            todo += [(Requirement(r), e) for r in requires]
    return {s.split("[")[0] for s in seen}


def _third_party_imports(files: list[Path]) -> set[str]:
    """Top-level modules imported anywhere in `files` (function-level imports included)."""
    names = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("framework", "tests")}


def test_the_readmes_install_line_brings_everything_the_hf_features_import():
    """What `pip install -e ".[test]"` then `".[hf]"` installs covers every module the framework
    and the HF tests import, and what transformers needs for the ZeRO-3 path we take through it
    (`HfDeepSpeedConfig` wants accelerate: transformers' own `deepspeed` extra)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = _readme_extras()
    assert {"test", "hf"} <= extras
    installed = _closure(
        project["dependencies"] + [r for e in sorted(extras) for r in project["optional-dependencies"][e]]
    )
    files = [
        *(ROOT / "framework").rglob("*.py"),
        ROOT / "tests" / "integrations" / "test_hf.py",
        ROOT / "tests" / "integrations" / "test_ecosystem.py",
    ]
    providers = metadata.packages_distributions()
    missing = {
        module: providers.get(module, ["?"])
        for module in _third_party_imports(files)
        if not {canonicalize_name(d) for d in providers.get(module, [])} & installed
    }
    assert not missing, f"imported but not installed by the README's line: {missing}"
    uses_zero3_path = any("HfDeepSpeedConfig" in f.read_text() for f in (ROOT / "framework").rglob("*.py"))
    assert uses_zero3_path
    needed = [
        Requirement(r)
        for r in metadata.requires("transformers") or []
        if Requirement(r).marker is not None and Requirement(r).marker.evaluate({"extra": "deepspeed"})
    ]
    assert needed and {canonicalize_name(r.name) for r in needed} <= installed


# ------------------------------------------------------------------------------------- tokenizers, classification

WORDS = "apple river stone cloud green quiet fast paper window music light table".split()


def rule_rows(n: int = 600, seed: int = 0) -> list[dict[str, str]]:
    """Generated (text, label) rows: "sunny" exactly when the word "sun" is in the text."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.choices(WORDS, k=rng.randint(4, 10))
        label = rng.choice(["sunny", "rainy"])
        if label == "sunny":
            words.insert(rng.randrange(len(words) + 1), "sun")
        rows.append({"text": " ".join(words), "label": label})
    return rows


def word_tokenizer(texts: list[str]) -> Any:
    """A word-level tokenizer trained on `texts` with the `tokenizers` library (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )


def tiny_bert(vocab_size: int, num_labels: int = 2) -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=num_labels,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(config)


@pytest.fixture(scope="module")
def classification_files(tmp_path_factory) -> Path:
    """rows.jsonl / rows.csv / rows.parquet of the same rows, and a tokenizer dir trained on them."""
    import datasets

    root = tmp_path_factory.mktemp("cls")
    rows = rule_rows()
    (root / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    table = datasets.Dataset.from_list(rows)
    table.to_csv(str(root / "rows.csv"), index=False)
    table.to_parquet(str(root / "rows.parquet"))
    word_tokenizer([r["text"] for r in rows]).save_pretrained(root / "tokenizer")
    return root


@pytest.mark.parametrize("suffix", ["jsonl", "csv", "parquet"])
def test_classification_rows_from_jsonl_csv_and_parquet(classification_files, suffix):
    from framework.data.datasets.text_classification import hf_classification

    splits = hf_classification(
        str(classification_files / f"rows.{suffix}"), tokenizer=str(classification_files / "tokenizer")
    )
    assert splits.labels == ["rainy", "sunny"] and (len(splits.train), len(splits.valid)) == (540, 60)
    batch = splits.collate_fn([splits.train[i] for i in range(4)])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    lengths = batch["attention_mask"].sum(1)
    assert batch["input_ids"].shape[1] == int(lengths.max()) and int(lengths.min()) < int(lengths.max())
    pad = splits.tokenizer.pad_token_id
    assert all((row[n:] == pad).all() for row, n in zip(batch["input_ids"], lengths.tolist()))
    sun = splits.tokenizer.convert_tokens_to_ids("sun")
    assert [int((row == sun).any()) for row in batch["input_ids"]] == batch["labels"].tolist()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_tiny_bert_learns_a_generated_rule_from_a_jsonl_file(classification_files, stage):
    from framework.data.datasets.text_classification import hf_classification
    from framework.integrations import hf
    from framework.observe.metrics import Accuracy

    splits = hf_classification(
        str(classification_files / "rows.jsonl"), tokenizer=str(classification_files / "tokenizer")
    )
    torch.manual_seed(0)
    model = tiny_bert(len(splits.tokenizer))
    hf.adopt(model, splits)
    assert model.config.id2label == {0: "rainy", 1: "sunny"} and model.config.label2id["sunny"] == 1
    engine = Engine(
        model,
        "model",
        functools.partial(torch.optim.AdamW, lr=3e-3),
        metrics={"accuracy": Accuracy()},
        strategy=Strategy(sharding={"stage": stage}),
    )
    history = engine.fit(splits.train, splits.valid, epochs=2, batch_size=32, collate_fn=splits.collate_fn)
    assert history["val_accuracy"][-1] >= 0.9


def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line_naming_both(classification_files):
    from framework import ConfigError
    from framework.data.datasets.text_classification import hf_classification
    from framework.integrations import hf

    splits = hf_classification(
        str(classification_files / "rows.jsonl"), tokenizer=str(classification_files / "tokenizer")
    )
    with pytest.raises(
        ConfigError,
        match=r"the tokenizer has 17 tokens but BertForSequenceClassification's vocabulary has 12",
    ):
        hf.adopt(tiny_bert(12), splits)
    with pytest.raises(ConfigError, match=r"the data has 2 classes \(rainy, sunny\) but .* num_labels=3"):
        hf.adopt(tiny_bert(17, num_labels=3), splits)
    hf.adopt(tiny_bert(20), splits)  # a larger vocabulary is fine (padded embeddings)


def test_a_dataset_target_may_return_a_dataset_dict():
    import datasets

    from framework import ConfigError
    from framework.data.datasets import Splits, as_splits

    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4], [5, 6]], "labels": [0, 1, 0]})
    splits = as_splits(datasets.DatasetDict(train=rows, validation=rows.select([0])))
    assert isinstance(splits, Splits) and len(splits.train) == 3 and len(splits.valid) == 1
    assert torch.equal(splits.train[1]["input_ids"], torch.tensor([3, 4]))  # tensors, ready to batch
    with pytest.raises(
        ConfigError, match=r"data.dataset returned splits \['train', 'extra'\]: name one 'validation'"
    ):
        as_splits(datasets.DatasetDict(train=rows, extra=rows))
    with pytest.raises(
        ConfigError, match="returned a list: a dataset target returns framework.data.datasets.Splits"
    ):
        as_splits([rows, rows])


@pytest.mark.slow
def test_the_cli_fine_tunes_a_classifier_dir_and_exports_it_with_its_tokenizer_and_class_names(
    classification_files, tmp_path
):
    """A BERT dir holding its tokenizer, `data=hf_classification` naming none: the run takes the
    model's (one line), learns the rule, and `export --hf` writes a dir whose model names the
    classes and whose tokenizer is the one it trained with."""
    model_dir = tmp_path / "bert"
    tokenizer = transformers.AutoTokenizer.from_pretrained(classification_files / "tokenizer")
    torch.manual_seed(0)
    tiny_bert(len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    run = run_train(
        [
            "model=hf_sequence_classification",
            f"model.path={model_dir}",
            "model.num_labels=2",
            "data=hf_classification",
            f"data.dataset.data_files={classification_files / 'rows.jsonl'}",
            "loss=model",
            "metrics.accuracy.num_classes=2",
            "scheduler=constant",
            "trainer.epochs=2",
            "trainer.batch_size=32",
            "trainer.log_freq=5",
        ],
        tmp_path / "run",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"data: the tokenizer of {model_dir}" in run.stdout
    log = (tmp_path / "run" / "train.log").read_text()  # the console, also in the run dir
    assert f"data: the tokenizer of {model_dir}" in log and "throughput:" in log
    assert json.loads((tmp_path / "run" / "final_metrics.json").read_text())["val_accuracy"] >= 0.9
    out = tmp_path / "exported"
    export = run_cmd(
        [sys.executable, "-m", "framework.export", str(tmp_path / "run" / "checkpoints"), str(out), "--hf"]
    )
    assert export.returncode == 0, export.stderr
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.id2label == {0: "rainy", 1: "sunny"} and model.config.label2id == {
        "rainy": 0,
        "sunny": 1,
    }
    reloaded = transformers.AutoTokenizer.from_pretrained(out)
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    with torch.no_grad():
        logits = model(**reloaded(["apple sun river", "apple stone river"], return_tensors="pt")).logits
    assert [model.config.id2label[int(i)] for i in logits.argmax(-1)] == ["sunny", "rainy"]


def test_hf_text_takes_the_tokenizer_of_the_models_directory(tmp_path, capsys):
    """model.path=DIR with a tokenizer in it and data=hf_text naming none: DIR is the tokenizer
    (before, the bytes of the text were the tokens, silently); a dir without one changes nothing."""
    from omegaconf import OmegaConf

    from framework.recipe.options import tokenizer_from_model_dir

    word_tokenizer([r["text"] for r in rule_rows(50)]).save_pretrained(tmp_path / "with")
    (tmp_path / "without").mkdir()
    for model_dir, expected in ((tmp_path / "with", str(tmp_path / "with")), (tmp_path / "without", None)):
        tree = {
            "model": OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "hf_causal_lm.yaml")),
            "data": OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "data" / "hf_text.yaml")),
        }
        tree["model"]["path"] = str(model_dir)
        tokenizer_from_model_dir(tree)
        assert tree["data"]["dataset"]["tokenizer"] == expected
    assert capsys.readouterr().out.count("data: the tokenizer of") == 1


# ------------------------------------------------------------------------------------- schedules


def lrs(schedule, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = schedule(optimizer)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_warm_up_takes_absolute_steps_as_well_as_a_fraction():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    node = OmegaConf.load(ROOT / "conf" / "scheduler" / "cosine.yaml")
    by_fraction = lrs(functools.partial(instantiate(node), total_steps=100), 100)
    assert by_fraction[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # 5 % of 100 steps
    node.warmup_steps = 10
    by_steps = lrs(functools.partial(instantiate(node), total_steps=100), 100)
    assert by_steps[:10] == pytest.approx([(i + 1) / 10 for i in range(10)]) and by_steps[10] == 1.0
    assert by_steps[-1] == pytest.approx(0.1, abs=1e-3) and by_steps[55] == pytest.approx(0.55)  # cosine
    constant = OmegaConf.load(ROOT / "conf" / "scheduler" / "constant.yaml")
    constant.warmup_steps = 4
    assert lrs(functools.partial(instantiate(constant), total_steps=100), 6) == pytest.approx(
        [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    )


# ------------------------------------------------------------------------------------- honest figures


@pytest.mark.parametrize("tied", [False, True])
def test_the_parameter_count_of_a_model_directory_is_its_models(tmp_path, tied):
    """Counted from a meta-device build of the directory's config (the ZeRO-3 log said 4.8 M for a
    2.39 M model: the weight files' bytes / 2), tied embeddings once."""
    from omegaconf import OmegaConf

    from framework.recipe.model import count_parameters

    model = tiny_llama()
    model.config.tie_word_embeddings = tied
    model = transformers.LlamaForCausalLM(model.config)
    model.save_pretrained(tmp_path)
    node = OmegaConf.create({"_target_": "framework.integrations.hf_models.causal_lm", "path": str(tmp_path)})
    assert count_parameters(node) == sum(p.numel() for p in model.parameters())


def test_a_resumed_run_says_from_which_step_and_checkpoint(tmp_path, capsys):
    from framework.data.datasets import synthetic
    from framework.models import MLP

    data = synthetic(num_samples=256).train

    def engine() -> Engine:
        torch.manual_seed(0)
        return Engine(
            MLP(hidden=[16]), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.SGD, lr=0.1)
        )

    engine().fit(data, epochs=1, batch_size=32, max_steps=3, save_dir=str(tmp_path))
    end_group()
    assert "resumed from" not in capsys.readouterr().out
    engine().fit(data, epochs=2, batch_size=32, max_steps=5, save_dir=str(tmp_path), resume="auto")
    assert f"resumed from step 3 ({tmp_path / 'step_00000003'})" in capsys.readouterr().out


def test_the_console_copy_keeps_plain_lines_and_leaves_live_redraws_out(tmp_path, capsys):
    from framework.observe.runlog import tee

    log = tmp_path / "train.log"
    with tee(log):
        print("\x1b[1mBertForSequenceClassification\x1b[0m (11,362 parameters)")
        sys.stdout.write("\r\x1b[2K\x1b[1Aepoch 1/2 ━━━━━━ 3/17\n")  # a progress bar redrawing itself
        print("Error: something", file=sys.stderr)
    assert log.read_text() == "BertForSequenceClassification (11,362 parameters)\nError: something\n"
    assert "epoch 1/2" in capsys.readouterr().out  # the terminal still gets everything


def test_feature_data_into_a_token_model_is_one_line():
    """The issue's first try, `model=hf_llama` on the default (digits) data: float features reach
    an embedding. One line naming the model, the dtype and what to use, not a torch traceback."""
    from framework import ConfigError

    data = [(torch.randn(8), torch.tensor(1)) for _ in range(8)]
    engine = Engine(tiny_llama(), "model", functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM looks up token ids .* gives it float32 inputs"):
        engine.fit(data, batch_size=4, epochs=1, progress=False)


def test_a_causal_lm_is_its_backbones_last_hidden_state_and_its_head():
    """The head of the backbone's last hidden state is the model's logits; a model that changes
    its logits after the head (Gemma 2's soft-capping) and a model that is no causal LM have none."""
    from framework.integrations import hf

    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 7))
    hidden, head = hf.causal_lm_parts(model)
    with torch.no_grad():
        assert torch.allclose(head(hidden(input_ids=ids)), model(input_ids=ids).logits, atol=1e-6)
    assert head is model.lm_head
    gemma = transformers.Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    assert hf.causal_lm_parts(transformers.Gemma2ForCausalLM(gemma)) is None
    assert hf.causal_lm_parts(model.model) is None  # the backbone alone: no head
