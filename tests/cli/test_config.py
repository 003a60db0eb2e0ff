"""The real conf/: every group option composes and instantiates; bad keys fail at composition."""

from __future__ import annotations

import pytest
import torch
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from framework.cli.argv import normalize
from framework.cli.config import GROUPS
from framework.cli.startup import prepare_argv
from framework.data.datasets import Splits
from framework.data.streams import Reader, Stream
from framework.errors import ConfigError
from framework.plan.strategy import Strategy
from framework.recipe import tree_of
from framework.recipe.build import strategy_of

from ..conftest import CONF


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_groups_match_the_defaults_list():
    defaults = (CONF / "train.yaml").read_text()
    for group in GROUPS:
        assert f"- {group}:" in defaults, group
        assert (CONF / group).is_dir(), group
    listed = {
        line.split("-", 1)[1].split(":")[0].strip()
        for line in defaults.splitlines()
        if ": " in line and line.startswith("  - ")
    }
    assert listed == set(GROUPS)  # every group of the defaults list takes both `+g=x` and `g=x`


@pytest.mark.parametrize(
    "form", ["+metrics=none", "+loss=lm", "+hparams_search=optuna", "+callbacks=early_stopping"]
)
def test_plus_form_works_for_every_group(compose, form):
    group, option = form[1:].split("=")
    assert normalize([form], set(GROUPS)) == [f"{group}={option}"]
    cfg = compose([form])  # without the rewrite Hydra fails: "Multiple values for {group}"
    if group == "hparams_search":  # a global package: it sets keys elsewhere
        assert cfg.trainer.monitor == "val_loss"
    else:
        assert cfg[group] is not None


def test_default_composition(compose):
    cfg = compose()
    assert cfg.model._target_ == "framework.models.MLP"
    assert cfg.strategy.sharding.stage == 0
    assert cfg.trainer.batch_size == 64 and cfg.trainer.devices == 1


@pytest.mark.parametrize("form", ["+strategy=zero3", "strategy=zero3"])
def test_both_strategy_forms_select_zero3(compose, form):
    assert compose([form]).strategy.sharding.stage == 3


def test_prepare_argv_rewrites_only_our_groups():
    argv = [
        str(CONF.parent / "train.py"),
        "+strategy=zero3",
        "++x=2",
        "-m",
        "+experiment=digits_cnn",
        "+hydra/launcher=x",
    ]
    prepare_argv(argv)
    assert argv[1:] == ["strategy=zero3", "++x=2", "-m", "experiment=digits_cnn", "+hydra/launcher=x"]
    assert normalize(["+model=cnn"], set(GROUPS)) == ["model=cnn"]


def test_an_option_in_the_config_store_passes_the_prechecks():
    """Hydra accepts an option registered in its ConfigStore, so the pre-checks do too."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group="model", name="stored_mlp", node={"_target_": "framework.models.MLP", "hidden": [8]})
    try:
        prepare_argv([str(CONF.parent / "train.py"), "model=stored_mlp"])
    finally:
        del store.repo["model"]["stored_mlp.yaml"]
    with pytest.raises(SystemExit):  # no longer stored: refused, so the check above did look
        prepare_argv([str(CONF.parent / "train.py"), "model=stored_mlp"])


@pytest.mark.parametrize("name", options("strategy"))
def test_every_strategy_option_builds_a_strategy(compose, name):
    assert isinstance(strategy_of(tree_of(compose([f"strategy={name}"]))), Strategy)


@pytest.mark.parametrize("name", options("model"))
def test_every_model_option_instantiates_and_runs(compose, name):
    if name in ("hf_causal_lm", "hf_sequence_classification"):  # a directory of the user's: see
        return  # tests/integrations/test_ecosystem.py and tests/integrations/test_hf.py
    model = instantiate(compose([f"model={name}"]).model)
    if name == "gpt":
        assert model(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 128)
    elif name.startswith("hf_"):
        assert model(torch.zeros(2, 16, dtype=torch.long)).logits.shape == (2, 16, 256)
    else:
        assert model(torch.zeros(2, 64)).shape == (2, 10)


@pytest.mark.parametrize("name", options("data"))
def test_every_data_option_instantiates(compose, name, tmp_path):
    overrides = [f"data={name}"]
    if name == "csv":  # a file of the user's: 64 feature columns and a label
        table = tmp_path / "table.csv"
        header = ",".join([f"f{i}" for i in range(64)] + ["label"])
        rows = [",".join(["0.5"] * 64 + [str(r % 10)]) for r in range(50)]
        table.write_text("\n".join([header, *rows]) + "\n")
        overrides.append(f"data.dataset.path={table}")
    if name == "hf_text":  # text files of the user's
        notes = tmp_path / "notes.txt"
        notes.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
        overrides.append(f"data.dataset.data_files={notes}")
        splits = instantiate(compose(overrides).data.dataset)
        assert set(splits.train[0]) == {"input_ids", "labels"} and len(splits.valid) > 0
        return
    if name == "hf_stream":  # a corpus of the user's, streamed: no length, blocks as it is read
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("".join(f"document {i} of the corpus\n" for i in range(100)))
        overrides += [f"data.dataset.data_files={corpus}", "data.dataset.block_size=16"]
        splits = instantiate(compose(overrides).data.dataset)
        block, _, _ = next(iter(Reader(splits.train, 0, 1, 0, {})))
        assert set(block) == {"input_ids", "labels"} and len(block["input_ids"]) == 16
        assert isinstance(splits.train, Stream) and splits.valid is not None
        return
    if name == "hf_chat":  # conversations of the user's, rendered by a tokenizer's chat template
        from tests.helpers.tiny_chat import tiny_chat_tokenizer, write_chat_jsonl

        tiny_chat_tokenizer().save_pretrained(tmp_path / "tokenizer")
        overrides += [f"data.dataset.data_files={write_chat_jsonl(tmp_path / 'chat.jsonl')}",
                      f"data.dataset.tokenizer={tmp_path / 'tokenizer'}"]  # fmt: skip
        splits = instantiate(compose(overrides).data.dataset)
        assert set(splits.train[0]) == {"input_ids", "labels", "attention_mask"}
        assert (len(splits.train), len(splits.valid)) == (7, 1)
        return
    if name == "hf_preference":  # pairs of answers of the user's, rendered by a chat template
        from tests.helpers.tiny_chat import tiny_chat_tokenizer
        from tests.helpers.tiny_pairs import write_pairs_jsonl

        tiny_chat_tokenizer().save_pretrained(tmp_path / "tokenizer")
        overrides += [f"data.dataset.data_files={write_pairs_jsonl(tmp_path / 'pairs.jsonl')}",
                      f"data.dataset.tokenizer={tmp_path / 'tokenizer'}"]  # fmt: skip
        splits = instantiate(compose(overrides).data.dataset)
        assert {"chosen_input_ids", "rejected_labels"} <= set(splits.train[0])
        assert (len(splits.train), len(splits.valid)) == (7, 1)
        return
    if name == "hf_prompts":  # prompts of the user's, for GRPO (text and chat), other columns kept
        from tests.helpers.tiny_chat import tiny_chat_tokenizer
        from tests.helpers.tiny_prompts import write_prompts_jsonl

        tiny_chat_tokenizer().save_pretrained(tmp_path / "tokenizer")
        overrides += [
            f"data.dataset.data_files={write_prompts_jsonl(tmp_path / 'prompts.jsonl')}",
            f"data.dataset.tokenizer={tmp_path / 'tokenizer'}",
        ]
        splits = instantiate(compose(overrides).data.dataset)
        assert {"prompt_ids", "prompt", "index", "animal"} <= set(splits.train[0])
        assert len(splits.train) == 32 and splits.valid is None and splits.train.tokenizer is not None
        batch = splits.collate_fn([splits.train[0], splits.train[20]])
        assert batch["prompt_mask"][0, 0] == 0 and batch["index"].tolist() == [0, 20]  # left-padded
        return
    if name == "hf_classification":  # (text, label) rows of the user's; byte tokens by default
        rows = tmp_path / "rows.jsonl"
        rows.write_text("".join(f'{{"text": "row {i}", "label": "{"ab"[i % 2]}"}}\n' for i in range(50)))
        overrides.append(f"data.dataset.data_files={rows}")
        splits = instantiate(compose(overrides).data.dataset)
        assert set(splits.train[0]) == {"input_ids", "attention_mask", "labels"} and splits.labels == [
            "a",
            "b",
        ]
        assert (len(splits.train), len(splits.valid)) == (45, 5)
        return
    splits = instantiate(compose(overrides).data.dataset)
    assert isinstance(splits, Splits) and len(splits.train) > len(splits.valid) > 0
    x, y = splits.train[0]
    assert (
        x.shape == (64,)
        and y.dtype == torch.long
        and x.dtype == (torch.long if name == "chars" else torch.float32)
    )


@pytest.mark.parametrize("name", options("optimizer"))
def test_every_optimizer_option_instantiates(compose, name):
    factory = instantiate(compose([f"optimizer={name}"]).optimizer)
    assert isinstance(factory([torch.nn.Parameter(torch.zeros(2))]), torch.optim.Optimizer)


@pytest.mark.parametrize("name", options("scheduler"))
def test_every_scheduler_option_instantiates(compose, name):
    factory = instantiate(compose([f"scheduler={name}"]).scheduler)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = factory(opt, total_steps=10)
    for _ in range(10):
        opt.step()
        sched.step()
    assert 0 < opt.param_groups[0]["lr"] <= 1.0


@pytest.mark.parametrize("name", options("logger"))
def test_every_logger_option_instantiates(compose, name, tmp_path):
    cfg = compose([f"logger={name}"])
    assert "console" in cfg.logger
    for node in cfg.logger.values():
        assert instantiate(node, output_dir=str(tmp_path)) is not None


@pytest.mark.parametrize("name", options("callbacks"))
def test_every_callbacks_option_instantiates(compose, name):
    for node in compose([f"callbacks={name}"]).callbacks.values():
        assert instantiate(node) is not None


@pytest.mark.parametrize("name", options("loss"))
def test_every_loss_option_instantiates(compose, name):
    loss = instantiate(compose([f"loss={name}"]).loss)
    if name == "model":  # the model computes it (Engine reads outputs.loss)
        from framework.data.outputs import is_model_loss

        assert is_model_loss(loss)
        return
    logits, target = (
        (torch.zeros(2, 5, 10), torch.ones(2, 5).long())
        if name == "lm"
        else (torch.zeros(2, 10), torch.tensor([1, 2]))
    )
    assert float(loss(logits, target)) > 0


@pytest.mark.parametrize("name", options("metrics"))
def test_every_metrics_option_instantiates(compose, name):
    for node in compose([f"metrics={name}"]).metrics.values():
        instantiate(node)


def test_gpt_experiment_composes_model_data_loss_and_pipeline(compose):
    cfg = compose(["experiment=gpt_pipeline"])
    assert cfg.model._target_ == "framework.models.GPT" and cfg.loss._target_ == "framework.models.LMLoss"
    assert cfg.strategy.pipeline.stages == 2 and dict(cfg.metrics) == {}


def test_typo_in_a_schema_key_fails_at_composition(compose):
    with pytest.raises(ConfigCompositionException) as err:
        compose(["trainer.epoch=3"])
    cause = err.value.__cause__
    assert isinstance(cause, (ConfigAttributeError, ConfigKeyError))
    assert "epoch" in str(cause) and "TrainerConfig" in str(cause)


@pytest.mark.parametrize(
    "override, words",
    [
        ("+trainer.epoch=3", ["trainer.epoch", "did you mean 'trainer.epochs'"]),
        ("+strategy.sharding.stag=3", ["strategy.sharding.stag", "did you mean 'strategy.sharding.stage'"]),
        ("+data.prefech=3", ["data.prefech", "did you mean 'data.prefetch'"]),
    ],
)
def test_keys_added_with_plus_are_checked_against_the_schema(compose, override, words):
    """Hydra lets `+key=...` add keys even to typed nodes; the run checks them before starting."""
    cfg = compose([override])
    with pytest.raises(ConfigError) as err:
        tree_of(cfg)
    for word in words:
        assert word in str(err.value)
    tree_of(compose())


def test_wrong_type_fails_at_composition(compose):
    with pytest.raises(ConfigCompositionException) as err:
        compose(["trainer.batch_size=big"])
    assert isinstance(err.value.__cause__, ValidationError)


def test_unknown_strategy_lists_the_options(compose):
    with pytest.raises(ConfigCompositionException) as err:
        compose(["strategy=zero9"])
    assert "zero3" in str(err.value)


def test_the_shipped_accuracy_equals_torchmetrics():
    import torchmetrics

    from framework.observe.metrics import Accuracy

    ours, theirs = Accuracy(), torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        logits, labels = torch.randn(16, 10, generator=g), torch.randint(0, 10, (16,), generator=g)
        ours.update(logits, labels)
        theirs.update(logits, labels)
    assert float(ours.compute()) == pytest.approx(float(theirs.compute()), abs=1e-7)
    restored = Accuracy()
    restored.load_state_dict(dict(ours.metric_state), strict=False)
    assert float(restored.compute()) == float(ours.compute())


def test_a_config_dir_that_does_not_exist_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        prepare_argv([str(CONF.parent / "train.py"), "-cd", str(tmp_path / "conf"), "model=mlp"])
    err = capsys.readouterr().err.strip()
    assert err == (
        f"Error: --config-dir {tmp_path / 'conf'}: no such directory (leave -cd out to use the framework's "
        "own configs, or make that directory with yours)"
    )


def test_the_adapter_group_composes_and_a_parallelism_it_lacks_is_refused_before_any_process(compose):
    from framework.integrations.peft import AdapterConfig
    from framework.recipe import validate

    cfg = compose(
        ["model=hf_llama", "+adapter=lora", "adapter.r=4", "adapter.target_modules=[q_proj,v_proj]"]
    )
    config = AdapterConfig(**tree_of(cfg)["adapter"]).peft_config()
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (4, 16, ["q_proj", "v_proj"])
    assert compose().get("adapter") is None  # no adapter unless asked for
    with pytest.raises(ConfigError, match="strategy.tensor_parallel.degree=1"):
        validate(compose(["+adapter=lora", "+strategy=tp2", "trainer.devices=2"]), world_size=2)
    with pytest.raises(ConfigError, match="unknown config key 'adapter.rank'"):
        validate(compose(["+adapter=lora", "+adapter.rank=4"]), world_size=1)
