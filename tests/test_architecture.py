"""The shape of the code: no import circles among framework modules, small modules and functions,
DeepSpeed's engine and JSON keys each behind one module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .conftest import ROOT

PACKAGE = ROOT / "framework"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path) -> set[str]:
    """Every framework module `path` imports, anywhere in the file (functions and TYPE_CHECKING
    blocks included). `from pkg import name` counts as importing `pkg.name` when that is a module."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if name in MODULES and name != module_name(path)}


def test_no_import_circle():
    graph = {name: imports_of(path) for name, path in MODULES.items()}
    # A package's __init__ re-exporting its own submodules is not a circle of responsibilities.
    for name in graph:
        graph[name] = {dep for dep in graph[name] if not (path_is_init(name) and dep.startswith(name + "."))}
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def path_is_init(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def test_no_module_over_400_lines_and_a_thin_engine():
    long = {name: n for name, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
    engine = ast.parse((PACKAGE / "engine" / "engine.py").read_text())
    (cls,) = [n for n in engine.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    assert cls.end_lineno - cls.lineno + 1 < 300


def test_no_function_over_60_lines():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.end_lineno - node.lineno + 1 > 60
            ):
                long.append(f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


@pytest.mark.parametrize(
    "needle, owner",
    [
        ("deepspeed.initialize", "framework.backend.runtime"),
        ("deepspeed_engine", "framework.backend.runtime"),
        ('"zero_optimization"', "framework.backend.ds_config"),
        ("train_micro_batch_size_per_gpu", "framework.backend.ds_config"),
        ("batch_layout(", "framework.backend.runtime"),
        ("world_size //", "framework.plan.run_plan"),
        ("lr_scheduler =", "framework.backend.runtime"),
    ],
)
def test_one_owner(needle, owner):
    """DeepSpeed's engine, its JSON keys, the batch split, the data-parallel degree and the
    learning-rate schedule each live in one module (the definition of `batch_layout` in plan.py
    and the CLI's check of it before a job starts aside)."""
    aside = {"framework.plan.run_plan", "framework.cli.build"} if needle == "batch_layout(" else set()
    users = {name for name, path in MODULES.items() if needle in path.read_text() and name not in aside}
    assert users <= {owner}, users
