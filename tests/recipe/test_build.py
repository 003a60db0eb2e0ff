"""`framework.build`: one recipe behind both doors. A command-line run replayed from its own
config.yaml by the Python API logs the same losses; SimPO and ORPO are their formulas at step 1
and train the same adapter on every layout; the same run from Python objects equals the CLI's;
every option of every options dataclass reaches the same object from either door."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from framework.engine.fit_config import LoaderConfig, LoopConfig, SaveConfig
from framework.errors import ConfigError
from framework.integrations.peft import AdapterConfig
from framework.methods import DPO, GRPO, ORPO, SFT, Method, SimPO, registered
from framework.methods.pairs import PairMethod
from framework.recipe import tree_of
from framework.recipe.options import fit_options, made
from tests.conftest import ROOT, run_cmd, run_train, torchrun
from tests.helpers.tiny_chat import tiny_chat_tokenizer, tiny_llama, write_chat_jsonl, write_tiny_llama
from tests.helpers.tiny_pairs import write_pairs_jsonl
from tests.methods.test_preference_methods import orpo_formula, simpo_formula


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama with its tokenizer in a directory, the 8 pairs and the chat conversations."""
    root = tmp_path_factory.mktemp("recipe")
    return SimpleNamespace(
        root=root,
        model_dir=write_tiny_llama(root / "llama"),
        pairs=write_pairs_jsonl(root / "pairs.jsonl"),
        chat=write_chat_jsonl(root / "chat.jsonl"),
    )


def pairs_args(t, *extra: str) -> list[str]:
    """LoRA (no dropout) on the tiny Llama over all 8 pairs per step, SGD, every step logged; the
    tokenizer is the model directory's (data.dataset.tokenizer left unset)."""
    return [
        "model=hf_causal_lm",
        f"model.path={t.model_dir}",
        "data=hf_preference",
        f"data.dataset.data_files={t.pairs}",
        "data.dataset.val_fraction=0",
        "+adapter=lora",
        "adapter.dropout=0",
        "optimizer=sgd",
        "optimizer.lr=0.5",
        "scheduler=constant",
        "metrics=none",
        "trainer.log_freq=1",
        "trainer.batch_size=8",
        "trainer.epochs=3",
        *extra,
    ]


ZERO3_X2 = ["+strategy=zero3", "trainer.devices=2"]


@pytest.fixture(scope="module")
def runs(tiny):
    """The command-line runs the tests below read, two at a time."""
    t = tiny
    jobs = {
        "dpo": pairs_args(
            t,
            "+objective=dpo",
            "objective.precompute_reference=true",
            "trainer.batch_size=4",
            "trainer.epochs=2",
            *ZERO3_X2,
        ),
        "simpo_zero3": pairs_args(
            t, "+objective=simpo", "objective.beta=2.0", "objective.gamma=0.5", *ZERO3_X2
        ),
        "simpo_zero0": pairs_args(t, "+objective=simpo", "objective.beta=2.0", "objective.gamma=0.5"),
        "orpo_zero3": pairs_args(t, "+objective=orpo", "objective.beta=0.1", "trainer.epochs=1", *ZERO3_X2),
        "custom": [
            "model=hf_causal_lm",
            f"model.path={t.model_dir}",
            "data=hf_chat",
            f"data.dataset.data_files={t.chat}",
            "data.dataset.val_fraction=0",
            "+objective=custom",
            "objective.name=examples.methods.smoothed_sft.SmoothedSFT",
            "+objective.epsilon=0.1",
            "optimizer=sgd",
            "optimizer.lr=0.1",
            "scheduler=constant",
            "metrics=none",
            "trainer.batch_size=4",
            "trainer.max_steps=2",
            "trainer.log_freq=1",
        ],
    }
    with ThreadPoolExecutor(2) as pool:
        started = {name: pool.submit(run_train, args, t.root / name, 300) for name, args in jobs.items()}
        done = {name: future.result() for name, future in started.items()}
    for name, run in done.items():
        assert run.returncode == 0, (name, run.stderr[-3000:])
    return SimpleNamespace(**{name: t.root / name for name in jobs}, output=done)


def step_records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "step"]


@pytest.mark.slow
def test_a_cli_run_replayed_from_its_config_by_the_python_api_logs_the_same_losses(tiny, runs, tmp_path):
    """DPO with LoRA, precomputed reference, ZeRO-3 on 2 processes, the tokenizer taken from the
    model directory: `framework.build(OmegaConf.load(RUN/config.yaml), output_dir=OUT).fit()` under
    torchrun logs the CLI run's step losses (1e-7)."""
    assert "data: the tokenizer of" in runs.output["dpo"].stdout
    replay = run_cmd(
        [*torchrun(2), str(ROOT / "tests" / "scripts" / "replay_build.py"), str(runs.dpo), str(tmp_path)]
    )
    assert replay.returncode == 0, replay.stderr[-3000:]
    cli, api = step_records(runs.dpo), step_records(tmp_path)
    assert len(cli) == len(api) == 4
    assert all(abs(a["loss"] - c["loss"]) <= 1e-7 for a, c in zip(api, cli)), (cli, api)
    assert abs(cli[-1]["loss"] - cli[0]["loss"]) > 1e-3  # it trained
    assert cli[0]["loss"] == pytest.approx(0.6931472, abs=1e-6)  # LoRA starts as its reference
    assert "rewards/accuracies" in api[-1] and "logps/chosen" in api[-1]


def base_pairs(t):
    """All 8 pairs as one batch and the base model, as the runs tokenize and load them."""
    from framework.data.datasets.preference import hf_preference
    from framework.integrations.hf_models import causal_lm

    data = hf_preference(str(t.pairs), tokenizer=str(t.model_dir), val_fraction=0)
    return data.collate_fn([data.train[i] for i in range(len(data.train))]), causal_lm(path=str(t.model_dir))


@pytest.mark.slow
def test_simpo_and_orpo_are_their_formulas_and_simpo_trains_the_same_adapter_on_every_layout(tiny, runs):
    """Step 1's loss (LoRA under ZeRO-3 x 2, a global batch of all pairs) is the formula at the
    base model's weights (1e-4); SimPO under ZeRO-3 x 2 and ZeRO-0 x 1 trains the same adapter
    (1e-5, SGD); each logs TRL's names."""
    from framework.export import fp32_state_dict

    batch, base = base_pairs(tiny)
    with torch.no_grad():
        simpo, orpo = simpo_formula(base, batch, 2.0, 0.5).item(), orpo_formula(base, batch, 0.1).item()
    simpo_steps, orpo_steps = step_records(runs.simpo_zero3), step_records(runs.orpo_zero3)
    assert simpo_steps[0]["loss"] == pytest.approx(simpo, abs=1e-4)
    assert orpo_steps[0]["loss"] == pytest.approx(orpo, abs=1e-4)
    assert {"rewards/accuracies", "logps/chosen", "logits/rejected"} <= set(simpo_steps[0])
    assert {"nll_loss", "log_odds_ratio", "log_odds_chosen"} <= set(orpo_steps[0])
    two, one = (
        fp32_state_dict(runs.__dict__[name] / "checkpoints") for name in ("simpo_zero3", "simpo_zero0")
    )
    adapters = [k for k in one if "lora_" in k]
    assert adapters and set(adapters) <= set(two)
    assert max((two[k] - one[k]).abs().max().item() for k in adapters) < 1e-5
    moved = max(one[k].abs().max().item() for k in adapters if "lora_B" in k)
    assert moved > 1e-3  # lora_B starts at 0: the adapter really trained
    zero0 = step_records(runs.simpo_zero0)
    assert all(abs(a["loss"] - b["loss"]) < 1e-5 for a, b in zip(simpo_steps, zero0))


@pytest.mark.slow
def test_the_same_run_from_python_objects_logs_the_clis_losses(tiny, runs):
    """SimPO with LoRA on one process, built from Python objects (the model, `Engine`, `SimPO`,
    `AdapterConfig`, conf/optimizer/sgd.yaml's SGD) as a user writes it, logs what
    `+objective=simpo` logged."""
    from framework import Callback, Engine
    from framework.data.datasets.preference import hf_preference
    from framework.integrations.hf_models import causal_lm
    from framework.recipe import seed_everything

    class Logged(Callback):
        losses: list[float] = []

        def on_step_end(self, state):
            if state.log_now:
                self.losses.append(state.logs["loss"])

    seed_everything(0)
    data = hf_preference(str(tiny.pairs), tokenizer=str(tiny.model_dir), val_fraction=0)
    engine = Engine(
        causal_lm(path=str(tiny.model_dir)),
        optimizer=functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9),
        train_step=SimPO(beta=2.0, gamma=0.5),
        adapter=AdapterConfig(dropout=0.0),
        callbacks=[Logged()],
    )
    with engine:
        engine.fit(data.train, batch_size=8, epochs=3, log_freq=1, collate_fn=data.collate_fn, progress=False)
    cli = [r["loss"] for r in step_records(runs.simpo_zero0)]
    assert len(Logged.losses) == len(cli) == 3
    assert max(abs(a - b) for a, b in zip(Logged.losses, cli)) <= 1e-7, (Logged.losses, cli)


@pytest.mark.slow
def test_a_method_of_the_users_own_is_selected_by_its_import_path(runs):
    steps = step_records(runs.custom)
    assert len(steps) == 2 and all(r["loss"] > 0 for r in steps)
    assert steps[0]["counted_items"] > 0  # what its loss counts (`items`), on one process too


# ----------------------------------------------------------------------------- both doors, every field

# A value other than the default for every field of every options dataclass; a field added without
# one here fails `test_every_field_of_every_options_dataclass_is_walked`.
# How every method that scores tokens scores them (`TokenScoring`): each changes how, not what.
SCORING: dict[str, object] = {"chunked_loss": False, "chunk_size": 3}
VALUES: dict[type, dict[str, object]] = {
    LoopConfig: {
        "epochs": 3,
        "max_steps": 7,
        "steps_per_epoch": 5,
        "batch_size": 32,
        "valid_batch_size": 16,
        "valid_steps": 2,
        "valid_freq": 2,
        "valid_at_start": True,
        "log_freq": 3,
        "timeout_s": 60.0,
        "resume": "auto",
        "peak_tflops": 1.5,
    },
    LoaderConfig: {
        "shuffle": False,
        "shuffle_window": 10,
        "num_workers": 1,
        "collate_fn": {"_target_": "framework.data.datasets.text_classification.PadCollator"},
    },
    SaveConfig: {"save_freq": 4, "keep_last_k": 1},
    AdapterConfig: {
        "r": 4,
        "alpha": 8,
        "dropout": 0.0,
        "target_modules": ["q_proj"],
        "modules_to_save": ["lm_head"],
        "use_dora": True,
    },
    SFT.Config: {**SCORING},
    DPO.Config: {
        "beta": 0.3,
        "loss_type": "ipo",
        "label_smoothing": 0.2,
        "precompute_reference": True,
        **SCORING,
    },
    SimPO.Config: {"beta": 1.0, "gamma": 1.0, **SCORING},
    ORPO.Config: {"beta": 0.5, **SCORING},
    GRPO.Config: {
        **SCORING,
        "num_generations": 4,
        "max_completion_length": 16,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "beta": 0.04,
        "epsilon": 0.1,
        "epsilon_high": 0.28,
        "num_iterations": 2,
        "loss_type": "grpo",
        "scale_rewards": "batch",
        "reward_funcs": ["examples.tiny_chat.rewards.meow_share"],
        "reward_weights": [2.0],
        "log_completions_every": 5,
    },
}
# What a method needs besides the field under test (GRPO: a reward function).
BASE: dict[type, dict[str, object]] = {
    GRPO.Config: {"reward_funcs": ["examples.tiny_chat.rewards.meow_share"]}
}
NODE = {
    LoopConfig: "trainer",
    LoaderConfig: "data",
    SaveConfig: "trainer.checkpoint",
    AdapterConfig: "adapter",
}


def options_classes() -> list[type]:
    """Every options dataclass a run is built from: fit's groups, the adapter's, each method's."""
    methods = [cls.Config for cls in registered().values() if dataclasses.fields(cls.Config)]
    return [LoopConfig, LoaderConfig, SaveConfig, AdapterConfig, *methods]


def test_every_field_of_every_options_dataclass_is_walked():
    for cls in options_classes():
        assert cls in VALUES, f"{cls.__name__}: give its fields a non-default value in VALUES"
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert set(VALUES[cls]) == set(fields), cls.__name__
        for name, value in VALUES[cls].items():
            default = fields[name].default
            assert value != default, f"{cls.__name__}.{name}: the walk needs a value other than the default"


def _override(key: str, value: object) -> str:
    if isinstance(value, dict):
        return f"+{key}={{{', '.join(f'{k}: {v}' for k, v in value.items())}}}"
    shown = "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) else str(value)
    return f"{key}={shown.lower() if isinstance(value, bool) else shown}"


def _method_of(config_class: type) -> type[Method]:
    return next(cls for cls in registered().values() if cls.Config is config_class)


@pytest.mark.parametrize("cls", options_classes(), ids=lambda c: c.__name__)
def test_both_doors_give_every_field_to_the_same_object(compose, tmp_path, cls):
    """Each field, set on the command line, reaches the object the run is built with, as the same
    field given to the Python API's class does: fit's options (`FitConfig`, which `Engine.fit`
    reads), the adapter's (`AdapterConfig`, which `Engine(adapter=...)` takes) and each method's."""
    for name, value in VALUES[cls].items():
        if cls in NODE:
            base = ["+adapter=lora"] if cls is AdapterConfig else []
            tree = tree_of(compose([*base, _override(f"{NODE[cls]}.{name}", value)]))
            if cls is AdapterConfig:
                got = AdapterConfig(**tree["adapter"])
            else:
                got = fit_options(tree, tmp_path, None, main=False)
            api = cls(**{name: value}) if cls is not LoaderConfig or name != "collate_fn" else None
        else:
            method = _method_of(cls)
            base = {k: v for k, v in BASE.get(cls, {}).items() if k != name}
            given = [_override(f"objective.{k}", v) for k, v in base.items()]
            tree = tree_of(
                compose([f"+objective={method.name}", *given, _override(f"objective.{name}", value)])
            )
            node = {k: v for k, v in tree["objective"].items() if k != "name"}
            got = made("objective", method, node).config
            api = method(**{**base, name: value}).config
        seen = getattr(got, name)
        if name == "collate_fn":
            assert type(seen).__name__ == "PadCollator"
        else:
            assert seen == value or list(seen) == value, (cls.__name__, name, seen)
            assert getattr(api, name) == seen


def _policy_and_batch():
    from framework.data.datasets.preference import PairCollator, PairEncoder
    from tests.helpers.tiny_pairs import PAIRS

    tok = tiny_chat_tokenizer()
    encoder = PairEncoder(tok, 256, ("prompt", "chosen", "rejected"))
    batch = PairCollator(tok.pad_token_id)([encoder.encode(p, str(i)) for i, p in enumerate(PAIRS)])
    policy, reference = tiny_llama(tok, seed=0), tiny_llama(tok, seed=1)
    runtime = SimpleNamespace(frozen=lambda module: module)  # no DeepSpeed: the copy stays as it is
    return SimpleNamespace(model=policy, module=policy, output_key=None, runtime=runtime), reference, batch


PAIR_METHODS = [
    m for m in registered().values() if issubclass(m, PairMethod) and dataclasses.fields(m.Config)
]


class _HeadProducts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products made inside the block whose output spans the vocabulary (the
    head's: the whole logits at once, or a chunk's)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == self.vocab:
            self.count += 1
        return out


@pytest.mark.parametrize("method", PAIR_METHODS, ids=lambda m: m.name)
def test_every_method_option_changes_what_the_method_does(method):
    """No option is stored and ignored: each one, changed, changes the loss of a batch (or, for
    `precompute_reference`, what the method does when an Engine takes it and when fit starts;
    for how tokens are scored, `chunked_loss` and `chunk_size`, which leave the loss as it is,
    whether the head gives logits and how many products of its weight it takes). GRPO's options,
    which act in its rollout, are walked in tests/methods/test_grpo.py."""
    host, reference, batch = _policy_and_batch()
    head = host.module.get_output_embeddings()
    logits_seen: list[bool] = []
    # logits: [rows, positions, vocabulary]
    head.register_forward_hook(lambda _m, _i, out: logits_seen.append(out.dim() == 3))

    def loss(**options):
        kwargs = {"reference": copy.deepcopy(reference)} if method is DPO else {}
        logits_seen.clear()
        with torch.no_grad(), _HeadProducts(head.out_features) as products:
            value = method(**options, **kwargs)(host, batch).item()
        return value, any(logits_seen), products.count

    default, logits, products = loss()
    assert not logits and products > 0
    for name, value in VALUES[method.Config].items():
        if name == "precompute_reference":
            plain, stored = DPO(), DPO(**{name: value})
            plain.attach(host), stored.attach(host)
            assert plain.reference.is_copy and not stored.reference.is_copy
            continue
        changed, logits, count = loss(**{name: value})
        if name == "chunked_loss":
            assert logits and changed == pytest.approx(default, abs=1e-6)
        elif name == "chunk_size":
            assert not logits and count > products and changed == pytest.approx(default, abs=1e-6)
        else:
            assert changed != pytest.approx(default, abs=1e-7), name


def test_an_option_error_names_the_parameter_from_python_and_the_key_from_the_config(compose):
    with pytest.raises(ConfigError, match=r"^SimPO\(beta=0\): must be > 0$"):
        SimPO(beta=0)
    with pytest.raises(ConfigError, match=r"^objective.beta=0: must be > 0$"):
        made("objective", SimPO, {"beta": 0})
    with pytest.raises(ConfigError, match=r"objective.gama=1: no such option; did you mean gamma"):
        made("objective", SimPO, {"gama": 1})


def test_a_value_left_missing_is_one_line_naming_its_key_from_either_door(compose):
    """`model=hf_causal_lm` without `model.path`: a ~40-line MissingMandatoryValue traceback once;
    then, the command line resolving its config to plain data, "model.path=???: no such
    directory" after the data had been read. Now one line naming the key, before anything is built."""
    from framework.cli.build import tree as cli_tree

    cfg = compose(["model=hf_causal_lm", "data=hf_text", "data.dataset.data_files=notes.txt", "loss=model"])
    want = r"^model.path is required: give it \(e.g. model.path=VALUE on the command line\)$"
    for given in (cfg, cli_tree(cfg)):
        with pytest.raises(ConfigError, match=want):
            tree_of(given)
    with pytest.raises(ConfigError, match=r"^data.dataset.data_files is required"):
        tree_of(cli_tree(compose(["model=hf_llama", "data=hf_text", "loss=model"])))
