"""Outputs written whole or not at all (`framework.checkpoint.staging`)."""

from __future__ import annotations

import errno

import pytest

from framework.checkpoint.staging import staged_dir, staged_file


def test_a_staged_dir_becomes_the_target_only_when_complete(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(OSError, match="No space left on device; nothing was written") as err:
        with staged_dir(target) as staged:
            (staged / "a.json").write_text("{}")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert err.value.filename == str(target) and list(tmp_path.iterdir()) == []
    target.mkdir()
    (target / "README.md").write_text("mine")
    (target / "a.json").write_text("old")
    with staged_dir(target) as staged:
        (staged / "a.json").write_text("new")
    assert (target / "README.md").read_text() == "mine" and (target / "a.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_staged_file_replaces_its_target_or_leaves_it(tmp_path):
    target = tmp_path / "w.safetensors"
    target.write_text("old")
    with pytest.raises(ValueError), staged_file(target) as staged:  # not a file-system error: as it is
        assert staged.suffix == ".safetensors"
        raise ValueError("bug")
    assert target.read_text() == "old" and list(tmp_path.iterdir()) == [target]
    with staged_file(target) as staged:
        staged.write_text("new")
    assert target.read_text() == "new" and list(tmp_path.iterdir()) == [target]
