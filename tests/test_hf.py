"""A Hugging Face user's first hour: padded batches under recompute, the `hf` extra, tokenizers
that belong to the model, text classification from files, and the numbers the run reports."""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest
import torch

from framework import Engine, Strategy, device

from .conftest import ROOT

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _fresh_group():
    yield
    device.destroy_process_group()


def tiny_llama(vocab_size: int = 64) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
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
        device.destroy_process_group()
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
        ROOT / "tests" / "test_hf.py",
        ROOT / "tests" / "test_ecosystem.py",
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
