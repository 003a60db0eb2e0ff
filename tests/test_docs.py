"""The examples of README.md and docs/ run, so they cannot rot.

Every ```python block of a page runs, top to bottom, in one namespace per page (as a doctest
session does), in a fresh working directory. A block that needs what a CPU test run does not
have is marked by an HTML comment on the line before it, and is only compiled:

    <!-- no-run: needs a GPU -->            compiled, never run (the reason is shown nowhere else)
    <!-- requires: transformers, datasets -->   runs when those modules import, else the page
                                                is skipped after its other blocks ran, saying why

A failing block fails the page's test with the file and line of the statement that raised.
Besides, every relative link of the README points at a file that exists, and yaml blocks parse.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from .conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$')
MARK = re.compile(r"^\s*<!--\s*(?P<kind>no-run|requires):\s*(?P<what>.*?)\s*-->\s*$")


@dataclass
class Block:
    """One fenced code block of a page."""

    path: Path
    line: int  # 1-based line of the block's first code line
    language: str
    source: str
    no_run: str = ""  # the reason it is only compiled
    requires: tuple[str, ...] = ()  # modules it needs
    prints: str = ""  # the ```text block after a "prints:" line that follows it: what it must print

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with the mark on the line before each, if any.
    Blocks inside lists or admonitions (indented fences) are dedented by their fence's indent."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        language = (opening["info"].split() or [""])[0].strip("{.").lower()
        body, j = [], i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence):
                if not closing["info"].strip():
                    break
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        previous = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mark = MARK.match(previous)
        snippet = SNIPPET.match("\n".join(body).strip())
        if snippet:  # pymdownx.snippets: the block shows (and runs) the file it names
            body = (ROOT / snippet["path"]).read_text().splitlines()
        block = Block(path, i + 2, language, "\n".join(body) + "\n")
        if mark and mark["kind"] == "no-run":
            block.no_run = mark["what"] or "marked no-run"
        elif mark:
            block.requires = tuple(re.split(r"[,\s]+", mark["what"].strip()))
        shown = blocks[-1] if blocks and previous.strip() == "prints:" else None
        if shown is not None and block.language == "text":
            shown.prints = block.source
        blocks.append(block)
        i = j + 1
    return blocks


def python_blocks(path: Path) -> list[Block]:
    return [b for b in blocks_of(path) if b.language in ("python", "py", "python3")]


def compiled(block: Block):
    """The block compiled so that tracebacks name the page and its line numbers."""
    padded = "\n" * (block.line - 1) + block.source
    return compile(padded, str(block.path), "exec")


def run_block(block: Block, namespace: dict) -> str:
    """Run one block in the page's namespace; what went wrong, with the page's line, or ""."""
    try:
        exec(compiled(block), namespace)
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(block.path)]
        line = frames[-1].lineno if frames else block.line
        trace = "".join(traceback.format_exception(exc)[-12:])
        return (
            f"{block.path.relative_to(ROOT)}:{line}: the example starting at line {block.line} raised "
            f"{type(exc).__name__}: {exc}\n\n{trace}"
        )
    return ""


def close_engines(namespace: dict) -> None:
    """End what the page's engines made (their process groups), as a script's exit would."""
    from framework import DistModel, Engine

    for value in list(namespace.values()):
        engine = value.engine if isinstance(value, DistModel) else value
        if isinstance(engine, Engine):
            engine.close()


def _page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


PYTHON_PAGES = [p for p in PAGES if python_blocks(p)]


def test_the_docs_have_runnable_examples():
    runnable = [b for p in PYTHON_PAGES for b in python_blocks(p) if not b.no_run]
    assert len(runnable) >= 10, [b.where for b in runnable]


def check_printed(block: Block, printed: str) -> None:
    """Each line the page says the block prints is printed (a line ending in "..." is abridged:
    its start must match), in order."""
    lines = iter(printed.splitlines())
    for shown in block.prints.strip().splitlines():
        start = shown.removesuffix("...").rstrip() if shown.endswith("...") else None
        if not any((line.startswith(start) if start is not None else line == shown) for line in lines):
            pytest.fail(
                f"{block.where}: the page says it prints\n  {shown}\nbut it printed:\n{printed}",
                pytrace=False,
            )


@pytest.mark.parametrize("path", PYTHON_PAGES, ids=_page_id)
def test_page_examples_run(path: Path, tmp_path, monkeypatch):
    blocks = python_blocks(path)
    for block in blocks:  # every block, run or not, is at least valid Python
        try:
            compiled(block)
        except SyntaxError as exc:
            pytest.fail(f"{block.path.relative_to(ROOT)}:{exc.lineno}: {exc.msg}", pytrace=False)
    monkeypatch.chdir(tmp_path)  # what a block writes stays out of the repository
    page = types.ModuleType("__docs__")  # a module, as a script's is (dataclasses look theirs up)
    monkeypatch.setitem(sys.modules, "__docs__", page)
    namespace: dict = page.__dict__
    missing = []
    try:
        for block in blocks:
            if block.no_run:
                continue
            if any(importlib.util.find_spec(module) is None for module in block.requires):
                missing.append(block.where)
                continue
            with contextlib.redirect_stdout(io.StringIO()) as out:
                failure = run_block(block, namespace)
            if failure:
                pytest.fail(failure, pytrace=False)
            if block.prints:
                check_printed(block, out.getvalue())
    finally:
        close_engines(namespace)
    if missing:
        needs = sorted({module for b in blocks for module in b.requires})
        pytest.skip(
            f"{', '.join(missing)} need {', '.join(needs)} (pip install -e '.[hf]'); the page's other "
            "examples ran"
        )


@pytest.mark.parametrize("path", PAGES, ids=_page_id)
def test_yaml_examples_parse(path: Path):
    for block in blocks_of(path):
        if block.language in ("yaml", "yml"):
            try:
                yaml.safe_load(block.source)
            except yaml.YAMLError as exc:
                pytest.fail(f"{block.where}: not YAML: {exc}", pytrace=False)


def test_readme_links_point_at_files():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t and not t.startswith("mailto:")]
    assert local, "the README links into docs/"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


# ------------------------------------------------------------------------- documented commands

SHELL = ("bash", "sh", "shell", "console", "")


def train_commands(path: Path) -> list[tuple[str, list[str]]]:
    """(page:line, overrides) of each `train.py` command in the page's shell blocks: continued
    lines joined, comments dropped, a sweep's comma lists taken at their first value; a command
    with `...` (a shortened one) is left out."""
    import shlex

    found = []
    for block in blocks_of(path):
        if block.language not in SHELL:
            continue
        text = block.source.replace("\\\n", " ")
        for offset, line in enumerate(text.splitlines()):
            words = shlex.split(line.removeprefix("$ "), comments=True) if "train.py" in line else []
            if "train.py" not in words or "..." in words:
                continue
            args = words[words.index("train.py") + 1 :]
            if "--help" in args:
                continue
            overrides = [_first_of_sweep(a) for a in args if not a.startswith("-")]
            found.append((f"{block.where}+{offset}", overrides))
    return found


def _first_of_sweep(override: str) -> str:
    key, _, value = override.partition("=")
    if "," in value and not value.startswith(("[", "{", "'", '"')):
        value = value.split(",")[0]
    return f"{key}={value}" if _ else override


COMMANDS = [c for page in PAGES for c in train_commands(page)]


def test_the_docs_have_train_commands():
    assert len(COMMANDS) > 40


@pytest.mark.parametrize("where,overrides", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_documented_train_command_composes_and_passes_the_schema(compose, where, overrides):
    from framework.cli.config import check_override

    for item in overrides:
        check_override(item)
    compose([o for o in overrides if not o.startswith("hydra")])
