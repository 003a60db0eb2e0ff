"""Checkpoints on disk (`framework.checkpoint.store`): a resume on another layout converts into a
cache and leaves the run that saved the checkpoint as it was."""

from __future__ import annotations

import json
import os

import torch

from framework.checkpoint import store
from framework.export import fp32_state_dict

from ..conftest import end_group
from .test_trust import engine, trained


def listing(root) -> dict[str, int]:
    """Every path under `root` with its mode."""
    return {str(p.relative_to(root)): p.stat().st_mode for p in sorted(root.rglob("*"))}


def test_a_resume_on_another_layout_writes_nothing_into_the_source_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRASPEED_CACHE", str(tmp_path / "cache"))
    ckpts = trained(tmp_path / "source" / "ckpts", stage=2)
    path = store.find_resumable(ckpts)
    meta = json.loads((path / store.COMPLETE).read_text())
    meta.update(dp_size=2, world_size=2)  # as if saved by 2 ranks: partitions to regroup
    (path / store.COMPLETE).write_text(json.dumps(meta))
    before = listing(tmp_path / "source")
    run = engine(2)
    run.load(str(path))  # converts for this layout, then loads
    loaded, saved = run.runtime.full_state_dict(), fp32_state_dict(path)
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert listing(tmp_path / "source") == before  # no conversion, no latest_universal
    assert list((tmp_path / "cache" / "universal").iterdir()) == []  # read by every rank, then removed
    end_group()


def test_a_conversion_beside_its_checkpoint_leaves_no_pointer_and_is_readable_as_any_dir(tmp_path):
    ckpts = trained(tmp_path, stage=2)
    out = store.to_universal(store.find_resumable(ckpts))  # what an export of a TP checkpoint does
    assert not (ckpts / "latest_universal").exists()  # DeepSpeed's converter writes one beside its output
    assert out.stat().st_mode & 0o777 == 0o777 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
