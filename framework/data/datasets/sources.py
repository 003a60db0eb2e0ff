"""Rows of your own local files (JSON Lines, a JSON array, Parquet), each with where it came from
(`"FILE line N"`, from 1), for chat and pairs data (`framework.data.datasets.chat`,
`framework.data.datasets.preference`).

JSON is read here, line by line, not through Hugging Face `datasets`: a file that cannot be read
is one line naming it, the line and what is wrong (an empty file, bytes that are not UTF-8, a line
that is not JSON or not an object), where `datasets` stopped at `StopIteration`, a
`UnicodeDecodeError` or a `DatasetGenerationError` counted from 0. Parquet goes through `datasets`
(`load_local`). A stream reads the same rows lazily (`streamed`): a `datasets.IterableDataset`
whose state resumes exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from framework.data.datasets.hf import load_local
from framework.errors import ConfigError

WHERE = "__where__"  # a streamed row's file and line, for errors
_DECODER = json.JSONDecoder()


def data_paths(data_files: Any, key: str = "data_files") -> list[Path]:
    """The files named by `data.dataset.<key>` (one or a list), each existing and not empty."""
    names = [data_files] if isinstance(data_files, (str, Path)) else list(data_files)
    paths = [Path(str(f)).expanduser() for f in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"data.dataset.{key}: no such file: {', '.join(missing)}")
    for path in paths:
        if path.stat().st_size == 0:
            raise ConfigError(
                f"{path} line 1: the file is empty (0 bytes); give a file with one row per line "
                f"(data.dataset.{key})"
            )
    return paths


def builder_of(path: Path, builder: str | None) -> str:
    """`json` or `parquet`: `builder` when given, else from the file's suffix."""
    return builder or ("parquet" if path.suffix.lower() == ".parquet" else "json")


def where(path: Path, builder: str, index: int) -> str:
    """How an error names row `index` (from 0) of a file."""
    return f"{path} {'line' if builder == 'json' else 'row'} {index + 1}"


def rows(path: Path, builder: str | None) -> Iterator[tuple[str, dict[str, Any], int]]:
    """(where, row, bytes of the file read so far) of each row of a file, in order."""
    kind = builder_of(path, builder)
    if kind == "json":
        for line, row, done in json_rows(path):
            yield f"{path} line {line}", row, done
        return
    size = path.stat().st_size
    table = load_local(kind, [path])
    for i, row in enumerate(table):
        yield where(path, kind, i), row, size * (i + 1) // max(1, len(table))


def first_row(path: Path, builder: str | None) -> tuple[str, dict[str, Any]]:
    """Where the file's first row is, and the row (what its format is told from)."""
    for at, row, _ in rows(path, builder):
        return at, row
    raise ConfigError(f"{path}: no rows (only blank lines); give a file with one row per line")


def json_rows(path: Path) -> Iterator[tuple[int, dict[str, Any], int]]:
    """(line, object, bytes read) of a JSON Lines file, or of a file holding one JSON array."""
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    if head.startswith(b"["):
        yield from _array_rows(path)
        return
    done = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            done += len(raw)
            text = _text(path, raw, number)
            if not text.strip():
                continue
            try:
                row = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{path} line {number}: not JSON ({exc.msg} at column {exc.colno}); a JSON Lines "
                    "file holds one object per line"
                ) from None
            yield number, _object(path, row, number), done


def _text(path: Path, raw: bytes, number: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, number, exc.start + 1, raw[exc.start]) from None


def _not_utf8(path: Path, line: int, column: int, byte: int) -> ConfigError:
    return ConfigError(
        f"{path} line {line}: not UTF-8 text (byte 0x{byte:02x} at column {column}); save the file as UTF-8"
    )


def _object(path: Path, row: Any, number: int) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ConfigError(
            f"{path} line {number}: a JSON {type(row).__name__} where a row is an object ({{...}})"
        )
    return row


def _array_rows(path: Path) -> Iterator[tuple[int, dict[str, Any], int]]:
    """The objects of a file holding one JSON array, each with the line it starts on."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, column = raw.count(b"\n", 0, exc.start) + 1, exc.start - raw.rfind(b"\n", 0, exc.start)
        raise _not_utf8(path, line, column, raw[exc.start]) from None
    at, line, seen = text.index("[") + 1, 1, 0
    while True:
        at = _skip_space(text, at)
        if text.startswith("]", at):
            return
        line += text.count("\n", seen, at)
        seen = at
        try:
            row, at = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{path} line {exc.lineno}: not JSON ({exc.msg} at column {exc.colno})"
            ) from None
        yield line, _object(path, row, line), len(raw) * at // len(text)
        at = _skip_space(text, at)
        if text.startswith(",", at):
            at += 1
        elif not text.startswith("]", at):
            lineno = text.count("\n", 0, at) + 1
            raise ConfigError(f"{path} line {lineno}: not JSON (expected ',' or ']' in the array)")


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _json_examples(path: str) -> Iterator[dict[str, Any]]:
    """A JSON file's rows for a stream, each with its file and line under `WHERE`."""
    for line, row, _ in json_rows(Path(path)):
        yield {**row, WHERE: f"{path} line {line}"}


class _Where:
    """Tags a streamed Parquet row with its file and row (picklable: a stream's reader copies
    its source)."""

    def __init__(self, path: Path, builder: str):
        self.path, self.builder = path, builder

    def __call__(self, example: dict[str, Any], index: int) -> dict[str, Any]:
        return {WHERE: where(self.path, self.builder, index)}


def streamed(paths: list[Path], builder: str | None) -> Any:
    """The rows of the files as one `datasets.IterableDataset` (read lazily, resumed exactly),
    each with its file and line under `WHERE`."""
    import datasets

    parts = []
    for path in paths:
        kind = builder_of(path, builder)
        if kind == "json":
            parts.append(
                datasets.IterableDataset.from_generator(_json_examples, gen_kwargs={"path": str(path)})
            )
        else:
            parts.append(load_local(kind, [path], streaming=True).map(_Where(path, kind), with_indices=True))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
