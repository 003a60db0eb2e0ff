"""Whether a checkpoint fits the run that loads it (`framework.checkpoint.compatibility`): an
adapter resumes only on the base weights it trained on, in process on a tiny Llama."""

from __future__ import annotations

import pytest

from framework import CheckpointError
from framework.checkpoint import store

from ..conftest import end_group

pytest.importorskip("peft")
pytest.importorskip("transformers")

from tests.helpers.tiny_lora import adapter_engine, token_data, train_adapter, write_base  # noqa: E402


def test_an_adapter_resumes_only_on_the_base_it_trained_on(tmp_path):
    base = write_base(tmp_path / "base")
    ckpts = train_adapter(base, tmp_path / "ckpts")
    end_group()
    recorded = store.read_meta(store.find_resumable(ckpts))["base"]
    assert recorded["path"] == str(base.resolve()) and len(recorded["sha256"]) == 64
    resumed = adapter_engine(base)  # the same base: resumes
    resumed.fit(token_data(), batch_size=4, epochs=2, shuffle=False, save_dir=str(ckpts), resume="auto")
    assert resumed.state.global_step == 6
    end_group()
    write_base(base, seed=1)  # replaced on disk: the same shapes, other weights
    with pytest.raises(
        CheckpointError, match="holds other weights than the one the adapter was trained on"
    ) as err:
        adapter_engine(base).fit(token_data(), batch_size=4, epochs=3, save_dir=str(ckpts), resume="auto")
    assert "\n" not in str(err.value) and "model.path" in str(err.value)
