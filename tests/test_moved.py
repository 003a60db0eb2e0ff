"""0.1.0's module paths that moved (`framework.device`, `.metrics`, `.weights`, `.steps`): importing
one is one ImportError line naming where its contents live now, and that place imports."""

from __future__ import annotations

import importlib
import sys

import pytest

NEW_HOMES = {
    "framework.device": "framework.process.context",  # its functions: ProcessContext's methods
    "framework.metrics": "framework.observe.metrics",
    "framework.weights": "framework.backend.weights",
    "framework.steps": "framework.engine.steps",
}


@pytest.mark.parametrize("old", sorted(NEW_HOMES))
def test_an_old_module_path_names_its_new_home(old):
    sys.modules.pop(old, None)
    with pytest.raises(ImportError) as raised:
        importlib.import_module(old)
    message = str(raised.value)
    assert "\n" not in message and old in message and "0.1.0" in message
    new = NEW_HOMES[old]
    assert (new if old != "framework.device" else "framework.ProcessContext") in message
    importlib.import_module(new)


def test_from_framework_import_an_old_name_fails_the_same_way():
    sys.modules.pop("framework.device", None)
    with pytest.raises(ImportError, match="methods of framework.ProcessContext"):
        from framework import device  # noqa: F401
