"""Chat and pairs files rendered once: the rows of a file kept on disk, so the next run with the
same file, tokenizer and options starts at once, and a progress bar (rank 0, on stderr) while a
file renders for more than `PROGRESS_AFTER_S` seconds.

A file's rows are kept under a key made of everything they depend on: the file's bytes (SHA-256:
an edited file never hits, whatever its time stamp), the tokenizer (its serialized vocabulary,
normalizer and pre- / post-processors, its chat template and special tokens), the options that
shape rows (format, columns, max_length, ...), and the code that renders them (these modules'
source, and the versions of transformers, tokenizers and jinja2). A hit gives the rows a fresh
render gives, token for token, and what was cut and dropped is said again.

Where (`data.dataset.cache`): true, `hydraspeed/rendered` under Hugging Face `datasets`' cache
(`~/.cache/huggingface/datasets`, moved by `HF_DATASETS_CACHE`); a directory, there; false, none.
One `.npz` file per file and key: delete the directory to reclaim the space. Streams are
rendered as they are read and not kept.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from framework.data.datasets.counted import say
from framework.data.datasets.sources import builder_of, first_row, rows
from framework.errors import ConfigError
from framework.integrations.hf import transformers_version
from framework.process.environment import env_rank

PROGRESS_AFTER_S = 3.0
MASK = "attention_mask"  # all ones: made again on loading, not kept
_SOURCES = (
    "answers.py",
    "cache.py",
    "chat.py",
    "counted.py",
    "formats.py",
    "preference.py",
    "render.py",
    "sources.py",
)


def cache_dir(cache: Any) -> Path | None:
    """The directory `data.dataset.cache` names (true: the default one; false / None: none)."""
    if cache is None or cache is False or str(cache).lower() in ("false", "none", "null", "0"):
        return None
    if cache is True or str(cache).lower() == "true":
        from datasets import config

        return Path(config.HF_DATASETS_CACHE) / "hydraspeed" / "rendered"
    return Path(str(cache)).expanduser()


@functools.cache
def code_version() -> str:
    """What renders rows: the source of these modules and the libraries that render templates."""
    from importlib import metadata

    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in (*_SOURCES, "../labels.py"):
        digest.update((here / name).read_bytes())
    for package in ("tokenizers", "jinja2"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            digest.update(f"{package}={metadata.version(package)}".encode())
    digest.update(f"transformers={transformers_version()}".encode())
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """What a tokenizer makes of text and of a chat (see the module doc)."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    template = getattr(tokenizer, "chat_template", None)
    digest.update(json.dumps(template, sort_keys=True, default=str).encode())
    special = getattr(tokenizer, "special_tokens_map", {})
    digest.update(json.dumps(special, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def fingerprint(*parts: Any) -> str:
    """One key of an encoder's options (JSON-able parts), its tokenizer and the code."""
    return hashlib.sha256(json.dumps([*parts, code_version()], default=str).encode()).hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def encode_files(
    encoder: Any, paths: list[Path], builder: str | None, cache: Any
) -> list[dict[str, np.ndarray]]:
    """The kept rows of the files, in order (`encoder`: a `ChatEncoder` or `PairEncoder`): each
    file's format said in one line, its rows from the cache or rendered (and kept there)."""
    directory = cache_dir(cache)
    kept = []
    for path in paths:
        say(encoder.read_as(*first_row(path, builder), path))
        entry = None
        if directory is not None:
            key = fingerprint(file_digest(path), builder_of(path, builder), encoder.fingerprint())
            entry = directory / f"{path.stem[:40]}-{key[:32]}.npz"
        hit = _load(entry)
        if hit is not None:
            encoder.add(hit[1])
            kept += hit[0]
            continue
        before = encoder.counts()
        rendered = []
        with _progress(path) as bar:
            for where, row, done in rows(path, builder):
                out = encoder.encode_row(row, where)
                if out is not None:
                    rendered.append(out)
                bar.update(done - bar.n)
        if entry is not None and env_rank() == 0:
            _save(entry, rendered, _minus(encoder.counts(), before))
        kept += rendered
    return kept


def _minus(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    drops = {k: n - before["drops"].get(k, 0) for k, n in after["drops"].items()}
    return {
        "seen": after["seen"] - before["seen"],
        "truncated": after["truncated"] - before["truncated"],
        "drops": {k: n for k, n in drops.items() if n},
    }


class _Quiet:
    n = 0

    def update(self, n: int) -> None:
        self.n += n


@contextlib.contextmanager
def _progress(path: Path) -> Iterator[Any]:
    """A bar over the file's bytes, shown once rendering takes `PROGRESS_AFTER_S` (rank 0);
    redrawn every 15 s where stderr is a file, not a terminal (a log keeps few lines of it)."""
    if env_rank() != 0:
        yield _Quiet()
        return
    from tqdm.auto import tqdm

    bar = tqdm(
        total=path.stat().st_size,
        unit="B",
        unit_scale=True,
        delay=PROGRESS_AFTER_S,
        file=sys.stderr,
        desc=f"data: rendering {path.name}",
        dynamic_ncols=True,
        mininterval=0.5 if sys.stderr.isatty() else 15.0,
    )
    try:
        yield bar
    finally:
        bar.close()


def _save(entry: Path, kept: list[dict[str, np.ndarray]], counts: dict[str, Any]) -> None:
    """The rows into `entry` (written aside, then renamed: a reader never sees half a file)."""
    keys = [k for k in (kept[0] if kept else {}) if not k.endswith(MASK)]
    masks = [k for k in (kept[0] if kept else {}) if k.endswith(MASK)]
    meta = {
        "counts": counts,
        "keys": keys,
        "masks": masks,
        "order": list(kept[0]) if kept else [],
        "rows": len(kept),
    }
    arrays: dict[str, Any] = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}
    for k in keys:
        values = [row[k] for row in kept]
        arrays[f"{k}.lengths"] = np.asarray([len(v) for v in values], dtype=np.int64)
        arrays[k] = np.concatenate(values).astype(np.int32) if values else np.zeros(0, np.int32)
    entry.parent.mkdir(parents=True, exist_ok=True)
    aside = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    try:
        with open(aside, "wb") as f:
            np.savez(f, **arrays)
        os.replace(aside, entry)
    except OSError as exc:  # a full or read-only disk costs the next run its head start, not this run
        aside.unlink(missing_ok=True)
        say(
            f"data: the rendered rows could not be kept in {entry.parent} ({exc.strerror}); data.dataset.cache=false to not try"
        )


def _load(entry: Path | None) -> tuple[list[dict[str, np.ndarray]], dict[str, Any]] | None:
    """The rows and counts kept in `entry`, or None."""
    if entry is None or not entry.is_file():
        return None
    try:
        with np.load(entry) as stored:
            meta = json.loads(stored["meta"].tobytes())
            columns = {k: _split(stored[k], stored[f"{k}.lengths"]) for k in meta["keys"] if meta["rows"]}
    except (OSError, ValueError, KeyError):  # unreadable: render again (and write it anew)
        return None
    out: list[dict[str, np.ndarray]] = [{} for _ in range(meta["rows"])]
    for k, values in columns.items():
        for row, value in zip(out, values):
            row[k] = value
    for mask in meta["masks"]:  # beside the input ids of the same side
        for row in out:
            row[mask] = np.ones(len(row[mask[: -len(MASK)] + "input_ids"]), dtype=np.int64)
    return [{k: row[k] for k in meta["order"]} for row in out], meta["counts"]


def _split(values: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return np.split(values.astype(np.int64), np.cumsum(lengths)[:-1])


def encoded_splits(
    encoder: Any,
    paths: list[Path],
    held_out: list[Path] | None,
    builder: str | None,
    cache: Any,
    val_fraction: float,
    split_seed: int,
) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """The kept rows of the training files and of validation (`encoder`: a factory of a
    `ChatEncoder` or `PairEncoder`), what each cut and dropped said in one line: validation from
    the `held_out` files, else `val_fraction` of the rows (a fixed split by `split_seed`)."""
    counted = encoder()
    kept = encode_files(counted, paths, builder, cache)
    counted.report("training " if held_out else "")
    if not kept:
        reason = max(counted.drops, key=lambda r: counted.drops[r], default="")
        raise ConfigError(
            f"data.dataset.data_files: no {counted.unit} left to learn from: {counted.why(reason)}"
        )
    validation: list[dict[str, np.ndarray]] = []
    if held_out is not None:
        checked = encoder()
        validation = encode_files(checked, held_out, builder, cache)
        checked.report("validation ")
    elif val_fraction:
        order = np.random.default_rng(split_seed).permutation(len(kept))
        chosen = set(order[: int(np.ceil(val_fraction * len(kept)))].tolist())
        validation = [c for i, c in enumerate(kept) if i in chosen]
        kept = [c for i, c in enumerate(kept) if i not in chosen]
    return kept, validation
