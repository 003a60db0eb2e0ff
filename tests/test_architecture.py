"""The shape of the code: packages in one order, each importing only those below it; DeepSpeed,
Hydra/OmegaConf and transformers each imported by one package; no import circles; small modules
and functions; DeepSpeed's engine and JSON keys each behind one module; no process state in
module globals."""

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


# The packages of `framework/`, lowest first: each may import itself and those before it, never
# one after it (each package's __init__ docstring says the same in words).
ORDER = [
    "errors",
    "process",
    "integrations",
    "plan",
    "data",
    "backend",
    "observe",
    "checkpoint",
    "engine",
    "methods",
    "recipe",
    "cli",
]
# On top of the order: the model catalog and the two commands (`python -m framework.export / .plot`).
TOP = {"models", "export", "plot"}
# 0.1.0's module paths that moved: each only raises one ImportError naming its new home (tests/test_moved.py).
MOVED = {"device", "metrics", "steps", "weights"}
# Third-party packages that one framework package alone may import.
OWNERS = {
    "deepspeed": "backend",
    "hydra": "cli",
    "omegaconf": "cli",
    "transformers": "integrations",
    "wandb": "observe",
    "peft": "integrations",
}


def package_of(module: str) -> str:
    """`framework.backend.runtime` -> `backend`; `framework` (the public API) -> ``."""
    return module.split(".")[1] if "." in module else ""


def external_imports(path: Path) -> set[str]:
    """Top-level names of the non-framework modules `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {"framework"}


def test_framework_has_few_top_level_entries():
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and p.stem not in MOVED}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(ORDER[1:]) | {"models"}, packages
    assert len(entries - {"__init__.py"}) <= 15, sorted(entries)


def test_every_package_states_its_rule():
    for name in [*ORDER[1:], "models"]:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text())) or ""
        assert "Rule:" in doc or name == "models", (
            f"framework/{name}/__init__.py: no 'Rule:' in its docstring"
        )


def test_packages_import_only_those_below_them():
    rank = {name: i for i, name in enumerate(ORDER)}
    wrong = []
    for name, path in MODULES.items():
        here = package_of(name)
        if here in TOP | MOVED or here == "":
            continue
        for dep in imports_of(path):
            there = package_of(dep)
            if there in TOP or rank.get(there, -1) > rank[here]:
                wrong.append(f"{name} imports {dep}")
    assert not wrong, "imports up the order: " + "; ".join(sorted(wrong))


@pytest.mark.parametrize("library", sorted(OWNERS))
def test_one_package_imports_each_library(library):
    owner = OWNERS[library]
    users = {name for name, path in MODULES.items() if library in external_imports(path)}
    assert {package_of(u) for u in users} <= {owner}, sorted(u for u in users if package_of(u) != owner)


def test_no_global_statement():
    """Process state lives in objects (`framework.process.context.ProcessContext` and the like),
    never in module globals rebound by `global`."""
    rebinding = [
        f"{name}:{node.lineno}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Global)
    ]
    assert not rebinding, rebinding


@pytest.mark.slow
def test_importing_the_framework_changes_no_environment_and_imports_no_deepspeed():
    import subprocess
    import sys

    code = (
        "import os, sys; before = dict(os.environ); import framework; "
        "print(sorted(m for m in ('deepspeed', 'hydra', 'omegaconf') if m in sys.modules)); "
        "import framework.cli; "
        "print(sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    imported, changed = run.stdout.strip().splitlines()[-2:]
    assert imported == "[]", f"importing framework imported {imported}"  # DeepSpeed: when a run starts
    assert changed == "[]", f"importing framework changed {changed}"


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


def _code_lines(fn: ast.FunctionDef) -> int:
    """Lines of `fn`'s body after its docstring."""
    body = (
        fn.body[1:]
        if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
        else fn.body
    )
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0


def test_no_module_over_400_lines_and_a_thin_engine():
    """The `Engine` is a facade: its methods hand the work to the runtime, the loops and the
    fine-grained flow in a few lines each (its constructor only stores what it is given); a
    method that grows logic belongs in one of those modules."""
    long = {name: n for name, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
    engine = ast.parse((PACKAGE / "engine" / "engine.py").read_text())
    (cls,) = [n for n in engine.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
    thick = {m.name: n for m in methods if (n := _code_lines(m)) > (30 if m.name == "__init__" else 6)}
    assert not thick, thick


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
        ("deepspeed_engine", "framework.backend.runtime framework.backend.runtime_state"),
        ('"zero_optimization"', "framework.backend.ds_config"),
        ("train_micro_batch_size_per_gpu", "framework.backend.ds_config"),
        ("batch_layout(", "framework.backend.topology"),
        ("world_size //", "framework.plan.run_plan"),
        ("lr_scheduler =", "framework.backend.runtime"),
    ],
)
def test_one_owner(needle, owner):
    """DeepSpeed's engine, its JSON keys, the batch split, the data-parallel degree and the
    learning-rate schedule each live in one module (the definition of `batch_layout` in the run
    plan, the CLI's check of it before a job starts and autotune's of the layouts it may try aside)."""
    aside = (
        {"framework.plan.run_plan", "framework.recipe.build", "framework.plan.tune"}
        if needle == "batch_layout("
        else set()
    )
    users = {name for name, path in MODULES.items() if needle in path.read_text() and name not in aside}
    assert users <= set(owner.split()), users


# What starts another process in a test: the fast tier (`pytest -m "not slow"`) runs none of it.
_STARTERS = {
    "run_train",
    "run_cmd",
    "popen",
    "torchrun",
    "run_layout_script",
    "launch_job",
    "SlurmCluster",
    "spawn",
}
_SUBPROCESS_CALLS = {"run", "Popen", "check_output", "check_call", "call"}


def _starts_processes(node: ast.AST, helpers: set[str]) -> bool:
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        func = call.func
        if isinstance(func, ast.Name) and func.id in _STARTERS | helpers:
            return True
        if (
            isinstance(func, ast.Attribute)
            and func.attr in _SUBPROCESS_CALLS
            and isinstance(func.value, ast.Name)
            and func.value.id == "subprocess"
        ):
            return True
    return False


def _is_slow(decorators: list[ast.expr]) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "slow" for d in decorators for n in ast.walk(d))


def test_tests_that_start_processes_are_marked_slow():
    """The fast tier is unit tests and in-process checks: a test that starts another process
    (train.py, torchrun, a launcher, a Slurm cluster), itself, through a helper of its module or
    through a fixture of it, carries `@pytest.mark.slow` (or its module's `pytestmark` does)."""
    unmarked = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_slow = any(
            isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
            and _is_slow([n.value])
            for n in tree.body
        )  # fmt: skip
        functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
        helpers: set[str] = set()
        for _ in range(3):  # helpers that call helpers
            helpers |= {
                f.name for f in functions if not f.name.startswith("test_") and _starts_processes(f, helpers)
            }
        for node in functions:
            fixtures = {a.arg for a in node.args.args} & helpers  # a fixture of its module that starts them
            if node.name.startswith("test_") and (_starts_processes(node, helpers) or fixtures):
                if not (module_slow or _is_slow(node.decorator_list)):
                    unmarked.append(f"{path.relative_to(ROOT)}::{node.name}")
    assert not unmarked, "start processes but are not marked slow: " + ", ".join(unmarked)
