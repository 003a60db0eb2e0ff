"""Whether a checkpoint fits the run that loads it (`framework.checkpoint.compatibility`): an
adapter resumes only on the base weights it trained on, in process on a tiny Llama."""

from __future__ import annotations

import pytest

from framework import CheckpointError
from framework.checkpoint import store

from ..conftest import end_group

pytest.importorskip("peft", reason="needs the hf extra: pip install -e '.[hf]'")
pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

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


def test_a_resume_that_changes_what_the_adapter_computes_is_refused_and_a_dropout_said(tmp_path, capsys):
    """alpha scales the adapter's output and DoRA decomposes it: resuming with another would train,
    and describe, the saved weights as something else (refused, one line); another dropout leaves
    the weights' meaning alone (said once, at the resume)."""
    base = write_base(tmp_path / "base")
    ckpts = train_adapter(base, tmp_path / "ckpts")
    end_group()
    for change, words in (({"alpha": 16}, "adapter.alpha=8"), ({"use_dora": True}, "adapter.use_dora=False")):
        with pytest.raises(CheckpointError, match=f"trained its adapter with {words}") as err:
            adapter_engine(base, **change).fit(
                token_data(), batch_size=4, epochs=2, save_dir=str(ckpts), resume="auto"
            )
        assert "\n" not in str(err.value)
        end_group()
    capsys.readouterr()
    resumed = adapter_engine(base, dropout=0.1)
    resumed.fit(
        token_data(),
        batch_size=4,
        epochs=2,
        shuffle=False,
        save_dir=str(ckpts),
        resume="auto",
        progress=False,
    )
    assert "resume: adapter.dropout 0.0 -> 0.1" in capsys.readouterr().out


def test_a_changed_method_option_is_said_at_the_resume():
    from framework.checkpoint.compatibility import changed_hyperparameters, method_record
    from framework.methods import DPO

    saved, now = method_record(DPO(beta=0.1)), method_record(DPO(beta=0.2))
    assert changed_hyperparameters({}, {}, saved, now) == [
        "DPO beta 0.1 -> 0.2 (objective.beta; the checkpoint trained with the first)"
    ]
    assert changed_hyperparameters({}, {}, saved, method_record(DPO(beta=0.1))) == []
