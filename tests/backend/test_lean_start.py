"""A run imports what it uses: importing the framework and building a run leaves mlflow (which
DeepSpeed's autotuner would import), SciPy and scikit-learn out of the process; a run that logs to
MLflow still gets the real module."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import run_cmd, subprocess_env

HEAVY = ("mlflow", "scipy", "sklearn")

DIGITS_RUN = """
import functools, json, sys
import torch
from framework import Engine, Strategy
from framework.data.datasets import digits
from framework.models import MLP
from framework.observe.metrics import Accuracy
train, valid = digits()
engine = Engine(MLP(), torch.nn.CrossEntropyLoss(), functools.partial(torch.optim.AdamW, lr=1e-3),
                strategy=Strategy(sharding={"stage": 3}), metrics=Accuracy())
engine.prepare("train", batch_size=64)
engine.close()
print(json.dumps(sorted(m for m in HEAVY if m in sys.modules) + ["deepspeed" in sys.modules]))
"""

LORA_RUN = """
import json, sys
import transformers  # imports SciPy itself when it is installed: not the framework's doing
from benchmarks.footprint import ours
ours()
print(json.dumps(sorted(m for m in HEAVY if m in sys.modules) + ["deepspeed" in sys.modules]))
"""

MLFLOW_AFTER = """
import json, sys
from framework.backend import deepspeed_globals
deepspeed_globals.load()
import mlflow
from mlflow.tracking import MlflowClient
print(json.dumps([mlflow.__name__, "deepspeed" in sys.modules]))
"""


def _last_json(code: str) -> list:
    run = run_cmd([sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{code}"], timeout=180, env=subprocess_env())
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_building_the_digits_run_imports_no_mlflow_scipy_or_sklearn():
    *imported, deepspeed_imported = _last_json(DIGITS_RUN)
    assert deepspeed_imported  # the run was built: DeepSpeed initialised
    assert imported == [], f"building the digits run imported {imported}"


@pytest.mark.slow
def test_building_a_lora_run_imports_no_mlflow_or_sklearn():
    pytest.importorskip("peft", reason="needs the hf extra: pip install -e '.[hf]'")
    *imported, deepspeed_imported = _last_json(LORA_RUN)
    assert deepspeed_imported
    assert not {"mlflow", "sklearn"} & set(imported), f"building a LoRA run imported {imported}"


@pytest.mark.slow
def test_mlflow_imports_whole_after_deepspeed():
    """The block on mlflow lasts only while DeepSpeed is first imported (`logger=mlflow` imports it)."""
    pytest.importorskip("mlflow", reason="needs the trackers extra: pip install -e '.[trackers]'")
    assert _last_json(MLFLOW_AFTER) == ["mlflow", True]
