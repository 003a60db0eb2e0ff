"""`python -m framework.export` of an adapter run (`framework.export`): written whole or not at all,
never over the base model, only with the base the adapter trained on, readable as any other file,
and every refusal one line. The checkpoint is trained in this process (a tiny Llama, seconds); the
file-system faults run the export as a process under a file-size limit or on a small filesystem."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from framework.checkpoint import safety, store
from framework.export import main as export

from .conftest import ROOT, end_group, subprocess_env

pytest.importorskip("peft", reason="needs the hf extra: pip install -e '.[hf]'")
pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from tests.helpers.tiny_lora import train_adapter, write_base  # noqa: E402


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory) -> tuple[Path, Path]:
    """(base model dir, checkpoints dir) of a LoRA run on a tiny Llama."""
    tmp = tmp_path_factory.mktemp("adapter")
    base = write_base(tmp / "base")
    ckpts = train_adapter(base, tmp / "ckpts")
    end_group()
    return base, ckpts


def one_line_error(capsys) -> str:
    """The one `Error: ...` line the export printed (after transformers' progress bars, if any)."""
    err = capsys.readouterr().err
    assert "Error: " in err and "Traceback" not in err, err
    line = err[err.index("Error: ") :]
    assert line.count("\n") == 1 and line.endswith("\n"), err
    return line


def test_an_export_never_writes_over_the_base_and_needs_the_base_it_trained_on(adapter_run, tmp_path, capsys):
    base, ckpts = adapter_run
    weights = safety.sha256(base / "model.safetensors")
    assert export([str(ckpts), str(base), "--hf", "--base", str(base)]) == 1
    assert "is the base model's own directory" in one_line_error(capsys)
    assert safety.sha256(base / "model.safetensors") == weights and not list(
        base.parent.glob(".base.staging-*")
    )
    other = write_base(tmp_path / "other", seed=1)  # the same shapes, other weights
    capsys.readouterr()  # transformers' progress bars while writing it
    for kind in ("--hf", "--adapter"):
        assert export([str(ckpts), str(tmp_path / "out"), kind, "--base", str(other)]) == 1
        assert "holds other weights than the one the adapter was trained on" in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_an_adapter_directory_is_readable_as_its_other_files_and_exports_warn_nothing(adapter_run, tmp_path):
    base, ckpts = adapter_run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert export([str(ckpts), str(tmp_path / "adapter"), "--adapter"]) == 0
        assert export([str(ckpts), str(tmp_path / "merged"), "--hf"]) == 0
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    mask = os.umask(0)
    os.umask(mask)
    for out in ("adapter", "merged"):
        modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / out).iterdir()}
        assert set(modes.values()) == {0o666 & ~mask}, modes
        assert (tmp_path / out).stat().st_mode & 0o777 == 0o777 & ~mask
    assert "adapter_model.safetensors" in os.listdir(tmp_path / "adapter")


def test_a_base_of_another_shape_is_one_line(adapter_run, tmp_path, capsys):
    base, ckpts = adapter_run
    older = tmp_path / "ckpts"  # a checkpoint without the base's fingerprint: the shapes are checked
    shutil.copytree(ckpts, older)
    path = store.find_resumable(older)
    meta = json.loads((path / store.COMPLETE).read_text())
    del meta["base"]
    (path / store.COMPLETE).write_text(json.dumps(meta))
    wide = write_base(tmp_path / "wide", hidden_size=64)
    capsys.readouterr()
    assert export([str(older), str(tmp_path / "out"), "--hf", "--base", str(wide)]) == 1
    err = one_line_error(capsys)
    assert (
        "is [4, 32] in the checkpoint, [4, 64] here" in err
        and "give the base model the run trained from" in err
    )


def exports_limited(exports: list[list[str]], limit: int) -> subprocess.CompletedProcess:
    """Each `python -m framework.export ARGS` of `exports`, one after the other in one process
    (printing `rc=N` for each) that may write files of `limit` bytes at most."""

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    code = f"from framework.export import main\nfor args in {exports!r}:\n    print(f'rc={{main(args)}}', flush=True)"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
        preexec_fn=limited,
    )


@pytest.mark.slow
def test_an_export_past_a_file_size_limit_is_one_line_and_leaves_nothing(adapter_run, tmp_path):
    """RLIMIT_FSIZE (`ulimit -f`) below the weights' size: the write fails half-way, as on a full disk."""
    base, ckpts = adapter_run
    outs = [tmp_path / "adapter", tmp_path / "merged", tmp_path / "weights.safetensors"]
    kinds = [["--adapter"], ["--hf"], []]
    run = exports_limited([[str(ckpts), str(out), *kind] for out, kind in zip(outs, kinds)], limit=12 * 1024)
    assert run.stdout.split() == ["rc=1"] * 3, run.stderr[-3000:]
    errors = [line[line.index("Error: ") :] for line in run.stderr.splitlines() if "Error: " in line]
    assert errors == [
        f"Error: cannot write {out} (File too large; nothing was written); free space or choose another path"
        for out in outs
    ], run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert list(tmp_path.iterdir()) == []  # neither a target nor a temporary dir or file
