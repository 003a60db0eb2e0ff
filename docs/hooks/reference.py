"""MkDocs hook: the reference tables that are generated from the code when the site is built.

A page asks for a table with an HTML comment on a line of its own:

    <!-- generated: config-schema -->      every key of the config schema (framework/recipe/schema.py
                                           and the dataclasses it is made of): type, default, one line
    <!-- generated: methods -->             every training method of framework.methods
    <!-- generated: config-groups -->      every config group under conf/ and its options
    <!-- generated: fields MODULE.CLASS --> the fields of one dataclass (e.g. FitConfig)
    <!-- generated: package-rules -->      framework's packages, lowest first, and each one's rule

Types and defaults come from the dataclasses themselves, the defaults of a run from the composed
`conf/train.yaml`, and each one-line description from the comment beside (or just above) the
field in the source, else from a sentence of the class docstring that names the field, else from
`EXTRA` below. A key without any description, or an `EXTRA` entry for a key that no longer
exists, is a warning, so `mkdocs build --strict` fails instead of publishing a stale table.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import io
import logging
import re
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("mkdocs.hooks.reference")

MARKER = re.compile(r"^<!-- generated: ([\w-]+)(?: ([\w.]+))? -->$", re.M)

# One-line descriptions of keys whose source has no comment and whose class docstring names
# them in no sentence of its own: config keys as written on the command line, fields of a
# dataclass shown with `fields` as "Class.field".
EXTRA = {
    "FitConfig.epochs": "passes over the training data",
    "FitConfig.batch_size": "the global batch: split over data-parallel ranks and accumulation steps",
    "FitConfig.steps_per_epoch": "cap of optimizer steps per epoch",
    "FitConfig.log_freq": "optimizer steps between logged lines / `metrics.jsonl` records",
    "FitConfig.save_dir": "checkpoints dir; None: no checkpoints",
    "FitConfig.save_freq": "optimizer steps between checkpoints (0: only when training ends)",
    "FitConfig.keep_last_k": "complete checkpoints kept (older ones deleted)",
    "FitConfig.resume": "`auto` (the newest complete checkpoint in `save_dir`) or a checkpoint's path",
    "FitConfig.handle_preemption": "save and stop at the next step boundary after SIGTERM / SIGUSR1 / SIGUSR2",
    "FitConfig.preemption_grace_s": "seconds from a preemption signal to the kill: a warning when a measured step and save exceed it",
    "LoopState.epoch": "the current epoch, from 0",
    "LoopState.epochs": "epochs this run trains",
    "LoopState.max_steps": "the run's cap of optimizer steps, if any",
    "LoopState.global_batch_size": "samples per optimizer step, all ranks together",
    "LoopState.logs": "this event's numbers: at STEP_END `lr` and `batches`, and `loss` when `log_now`; `val_*` at VALIDATION_END; the epoch's summary at EPOCH_END",
    "LoopState.history": "per-epoch lists of every logged value (what `fit` returns)",
    "LoopState.stop_training": "set to True to end training after this step",
    "LoopState.stop_reason": "why training was stopped (shown in the summary)",
    "LoopState.last_checkpoint": "path of the newest checkpoint this run wrote",
    "LoopState.elapsed_s": "seconds since training started, as of the last epoch end",
    "LoopState.info.model_name": "the model's class name",
    "LoopState.info.parameters": "the model's parameter count",
    "LoopState.info.world_size": "processes in the job",
    "LoopState.info.device_type": "`cuda` or `cpu`",
    "FitConfig.valid_freq": "validate every N epochs (when `valid_data` is given)",
    "FitConfig.max_steps": "stop after this many optimizer steps",
    "FitConfig.valid_batch_size": "global batch of validation (default: `batch_size`)",
    "FitConfig.shuffle": "shuffle the training data each epoch (seeded by the engine's `seed`)",
    "FitConfig.collate_fn": "turns a list of samples into a batch (default: torch's)",
    "FitConfig.num_workers": "DataLoader worker processes",
    "FitConfig.valid_at_start": "also validate before the first step (logged as `start_val_*`)",
    "model": "the model: a config group (`model=mlp`) or any `_target_`",
    "optimizer": "a torch optimizer factory (`_partial_: true`): a config group or any `_target_`",
    "scheduler": "a learning-rate schedule factory stepped once per optimizer step",
    "loss": "`loss(outputs, labels) -> scalar`, or `model` for the loss the model computes itself",
    "metrics": "torchmetrics-style metrics by name, synced across ranks",
    "logger": "loggers by name (console, wandb, tensorboard, mlflow; several as a list); `metrics.jsonl` is always written",
    "callbacks": "extra callbacks by name (early_stopping, keep_best, lr_monitor)",
    "trainer.epochs": "passes over the training set",
    "trainer.seed": "seed of the weights' initialisation and of the data shuffling",
    "trainer.checkpoint.enabled": "write checkpoints at all",
    "trainer.checkpoint.grace_s": "seconds from a preemption signal to the kill (Slurm's `KillWait`, 30 by default): a warning when a measured step and save exceed it, and the margin left in the preemption message",
    "strategy.sharding.stage": "ZeRO stage: 0 plain data parallel, 1 optimizer states, 2 + gradients, 3 + parameters partitioned",
    "strategy.pipeline.micro_batch_size": "samples per micro-batch (None: derived from the global batch)",
    "strategy.pipeline.accumulate_steps": "micro-batches pushed through the stages per optimizer step",
    "strategy.tensor_parallel.plan": "module name pattern -> `column` / `row` / `replicate` / `column:K` (default: the model's own plan)",
    "strategy.tensor_parallel.preset": "DeepSpeed AutoTP's preset for the model family (`llama`, `qwen2`, `mixtral`, ...)",
    "trainer.batch_size": "the global batch: split over data-parallel ranks and accumulation steps",
    "strategy.sharding.reduce_bucket_size": "elements per gradient reduce bucket (`auto`: sized from the model)",
    "strategy.sharding.allgather_bucket_size": "elements per parameter all-gather bucket (`auto`: sized from the model)",
    "strategy.sharding.prefetch_bucket_size": "ZeRO-3: elements of parameters fetched ahead of use (`auto`: the largest parameter)",
    "strategy.sharding.param_persistence_threshold": "ZeRO-3: parameters smaller than this stay whole on every rank (`auto`)",
    "strategy.sharding.max_live_parameters": "ZeRO-3: gathered elements alive at once (`auto`: two prefetch buckets)",
    "strategy.sharding.max_reuse_distance": "ZeRO-3: a gathered parameter stays whole if used again within this many elements (`auto`)",
    "strategy.sharding.sub_group_size": "elements per optimizer-step chunk (`auto`: a quarter of the model)",
    "strategy.amp.enable": "compute in `dtype` (DeepSpeed keeps fp32 master weights)",
    "strategy.recompute.enable": "recompute each block's activations in backward instead of storing them",
    "strategy.pipeline.stages": "pipeline stages the model's layers are split over (1: no pipeline)",
    "strategy.pipeline.schedule": "the pipeline schedule (DeepSpeed's 1F1B)",
    "strategy.pipeline.activation_checkpoint_interval": "recompute every N layers under the pipeline (0: off)",
    "strategy.sequence_parallel.degree": "ranks each sequence is split over (1: off)",
    "strategy.expert_parallel.degree": "data-parallel ranks each MoE layer's experts are split over (1: off)",
    "strategy.expert_parallel.preset": "the MoE layout (`mixtral`, `qwen3_moe`, ...); None detects it",
    "strategy.tensor_parallel.degree": "ranks each split linear layer is divided over (1: off)",
    "strategy.gradient_clip.max_norm": "clip the global gradient norm to this (0: off)",
    "strategy.gradient_merge.k_steps": "micro-batches per optimizer step (gradient accumulation)",
    "strategy.deepspeed": "raw DeepSpeed config keys, merged last over what the sections produce",
}


# ----------------------------------------------------------------------------- source comments


def _comments(module: Any) -> dict[int, str]:
    """Line number -> the text of the `#` comment on that line, for a module's source."""
    source = inspect.getsource(module)
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string.lstrip("#").strip()
    return found


def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment beside its definition (any of its lines) or the comment lines
    directly above it, in `cls` or the dataclass it inherits the field from."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if (
            dataclasses.is_dataclass(base)
            and base.__module__ in sys.modules
            and base.__name__ in vars(sys.modules[base.__module__])
        ):
            out.update(_own_field_comments(base))
    return out


def _own_field_comments(cls: type) -> dict[str, str]:
    """`_field_comments` of the fields `cls`'s own body defines."""
    module = sys.modules[cls.__module__]
    comments = _comments(module)
    lines = inspect.getsource(module).splitlines()
    tree = ast.parse(inspect.getsource(module))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    out = {}
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        text = next((comments[n] for n in range(item.lineno, item.end_lineno + 1) if n in comments), "")
        if not text:
            above, n = [], item.lineno - 1
            while n >= 1 and lines[n - 1].strip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            text = " ".join(above)
        if text:
            out[item.target.id] = text
    return out


def _sentences(text: str) -> list[str]:
    """`text` cut at ". " and "; " outside parentheses."""
    out, depth, current = [], 0, ""
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        current += ch
        if depth == 0 and ch in ".;" and text[i + 1 : i + 2] in (" ", ""):
            out.append(current.strip().rstrip(".;"))
            current = ""
    return [*out, current.strip()] if current.strip() else out


def _docstring_sentence(cls: type, name: str) -> str:
    """The first sentence of the class docstring that names `name` in backticks."""
    doc = " ".join((inspect.getdoc(cls) or "").split())
    return next((s for s in _sentences(doc) if f"`{name}`" in s), "")


# ----------------------------------------------------------------------------- rows


def _dataclass_type(cls: type, f: dataclasses.Field) -> type | None:
    hint = typing.get_type_hints(cls).get(f.name)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _show(value: Any) -> str:
    if value is dataclasses.MISSING or value == "???":
        return "required"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "":
        return '`""`'
    if isinstance(value, dict) and "_target_" in value:
        return f"`{value['_target_']}`"
    if callable(value) or (hasattr(value, "__dict__") and type(value).__repr__ is object.__repr__):
        return f"`{getattr(value, '__name__', type(value).__name__ + '()')}`"
    text = str(value)
    return f"`{text}`" if len(text) < 60 else f"`{text[:57]}...`"


Section = tuple[str, str, list[tuple[str, str, str, str]]]  # key, what it is, rows


def _sections(cls: type, prefix: str, composed: Any, extra_prefix: str, used: set[str]) -> list[Section]:
    """One section for `cls`'s own fields (key, type, default, description), then one per nested
    dataclass field, depth first. `composed`: the config whose values are a run's defaults."""
    comments = _field_comments(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        sub = _dataclass_type(cls, f)
        if sub is not None:
            nested.append((key, sub))
            continue
        lookup = f"{extra_prefix}{key}"
        used.add(lookup)
        described = comments.get(f.name) or EXTRA.get(lookup) or _docstring_sentence(cls, f.name)
        if not described:
            log.warning(f"generated reference: {lookup} has no description; comment the field in its source")
        default = _default(f) if composed is None else _select(composed, key, _default(f))
        if composed is not None and key in _chosen_options():
            default = f"`{_chosen_options()[key]}`" + " (group)"
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        shown = default if isinstance(default, str) and default.endswith("(group)") else _show(default)
        rows.append((key, type_name, shown, described))
    doc = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
    out: list[Section] = [(prefix.rstrip("."), doc, rows)] if rows else []
    for key, sub in nested:
        out += _sections(sub, f"{key}.", composed, extra_prefix, used)
    return out


def _chosen_options() -> dict[str, str]:
    """Group -> the option `conf/train.yaml` picks by default (a value null names none)."""
    import yaml

    defaults = yaml.safe_load((ROOT / "conf" / "train.yaml").read_text())["defaults"]
    return {k: str(v) for item in defaults if isinstance(item, dict) for k, v in item.items() if v}


def _select(composed: Any, key: str, fallback: Any) -> Any:
    from omegaconf import OmegaConf

    missing = object()
    value = OmegaConf.select(composed, key, default=missing)
    if value is missing:
        return fallback
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _md(text: str) -> str:
    """Source text as literal Markdown: code spans kept, everything else escaped."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = re.sub(r"([\\*_|\[\]{}])", r"\\\1", parts[i]).replace("<", "&lt;")
    return "`".join(parts)


def _table(rows: list[tuple[str, str, str, str]]) -> str:
    out = ["| key | type | default | description |", "|---|---|---|---|"]
    for key, type_name, default, described in rows:
        out.append(f"| `{key}` | `{type_name}` | {default} | {_md(described)} |")
    return "\n".join(out)


# ----------------------------------------------------------------------------- the generators


def _composed() -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from framework.cli.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train")


def config_schema() -> str:
    """Every key of the schema, one table per section, with the defaults of `python train.py`."""
    from framework.recipe.schema import RunConfig

    used: set[str] = set()
    parts = []
    for key, doc, rows in _sections(RunConfig, "", _composed(), "", used):
        heading = f"### `{key}`\n\n{doc}\n\n" if key else f"{doc}\n\n"
        parts.append(heading + _table(rows) + "\n")
    stale = sorted(k for k in EXTRA if k[0].islower() and k not in used)  # "Class.field" keys: fields_of
    if stale:
        log.warning(f"generated reference: EXTRA describes keys the schema no longer has: {stale}")
    return "\n".join(parts)


def _first_comment(path: Path) -> str:
    """The first sentence of a YAML file's leading comment (`@package` lines and commands skipped)."""
    words = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            if words:
                break
            continue
        text = line.lstrip("#")
        if text.strip().startswith("@package"):
            continue
        if text.startswith("   "):  # an example command
            break
        before, command, _ = text.partition("python train.py")
        words.append(before.strip().rstrip(":").strip())
        if command:
            break
    sentence = " ".join(words)
    sentence = re.split(r"(?<=\.)\s|:\s+python", sentence)[0]
    return sentence.rstrip(".:;, ")


def config_groups() -> str:
    """Each group of conf/ with its options, the default marked, one line from each file."""
    import yaml

    chosen = _chosen_options()
    out = ["| group | option | what it is |", "|---|---|---|"]
    for group_dir in sorted(p for p in (ROOT / "conf").iterdir() if p.is_dir() and p.name != "hydra"):
        group = group_dir.name
        for option in sorted(group_dir.glob("*.yaml")):
            name = option.stem
            about = _first_comment(option)
            if not about:
                target = (yaml.safe_load(option.read_text()) or {}).get("_target_")
                about = f"`{target}`" if target else ""
            mark = " (default)" if chosen.get(group) == name else ""
            out.append(f"| `{group}` | `{name}`{mark} | {_md(about)} |")
    launcher = ROOT / "conf" / "hydra" / "launcher"
    for option in sorted(launcher.glob("*.yaml")):
        out.append(f"| `hydra/launcher` | `{option.stem}` | {_md(_first_comment(option))} |")
    return "\n".join(out)


def fields_of(dotted: str) -> str:
    """The fields of one dataclass (and of its nested dataclasses) as tables."""
    module_name, _, name = dotted.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name)
    used: set[str] = set()
    sections = _sections(cls, "", None, f"{name}.", used)
    stale = sorted(k for k in EXTRA if k.startswith(f"{name}.") and k not in used)
    if stale:
        log.warning(f"generated reference: EXTRA describes fields {name} no longer has: {stale}")
    return "\n\n".join(_table(rows) for _, _, rows in sections)


def package_rules() -> str:
    """framework's packages in the architecture test's order, lowest first: what each holds (the
    first sentence of its docstring) and its rule (the docstring's `Rule:` paragraph)."""
    test = ast.parse((ROOT / "tests" / "test_architecture.py").read_text())
    order = next(
        (
            ast.literal_eval(node.value)
            for node in test.body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "ORDER" for t in node.targets)
        ),
        None,
    )
    if order is None:
        log.warning("contributing page: tests/test_architecture.py has no ORDER list of packages")
        return ""
    out = ["| package | holds | rule |", "|---|---|---|"]
    for name in [*order, "models"]:
        path = ROOT / "framework" / (f"{name}.py" if name == "errors" else f"{name}/__init__.py")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
        holds = paragraphs[0] if paragraphs else ""
        rule = next((p.removeprefix("Rule: ") for p in paragraphs if p.startswith("Rule:")), "")
        if not holds:
            log.warning(f"contributing page: framework/{name} has no docstring")
        out.append(f"| `framework.{name}` | {_md(holds)} | {_md(rule) or '—'} |")
    return "\n".join(out)


def methods() -> str:
    """Every training method of `framework.methods`: its `+objective=` name, its class, what it
    is (its docstring's first sentence) and its page."""
    from framework.methods import registered

    out = ["| `+objective=` | Python | what it is | options |", "|---|---|---|---|"]
    for name, cls in sorted(registered().items()):
        module = sys.modules[cls.__module__]
        about = " ".join((inspect.getdoc(module) or "").split("\n\n")[0].split())
        own = set(vars(cls.Config).get("__annotations__", {}))  # its own options first, then the shared
        fields = sorted(dataclasses.fields(cls.Config), key=lambda f: f.name not in own)
        options = ", ".join(f"`{f.name}`" for f in fields) or "—"
        page = (
            f"[{cls.__name__}]({name}.md)"
            if (ROOT / "docs" / "methods" / f"{name}.md").is_file()
            else f"`{cls.__name__}`"
        )
        out.append(f"| `{name}` | {page} | {_md(about)} | {options} |")
    return "\n".join(out)


GENERATORS = {
    "config-schema": config_schema,
    "config-groups": config_groups,
    "package-rules": package_rules,
    "methods": methods,
}


def _title(page: Path) -> str:
    """A page's first heading."""
    for line in page.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return page.stem


def on_config(config: Any) -> Any:
    """The framework imports from this checkout, whatever is installed; every page of
    `docs/methods/` joins the nav under "Training methods" (its index first), so that a new
    method's page needs no edit of mkdocs.yml."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    folder = ROOT / "docs" / "methods"
    pages = sorted(p for p in folder.glob("*.md") if p.name != "index.md")
    section = ["methods/index.md", *({_title(p): f"methods/{p.name}"} for p in pages)]
    nav = config["nav"]
    at = next(
        (i for i, item in enumerate(nav) if isinstance(item, dict) and "How-to guides" in item), len(nav) - 1
    )
    nav.insert(at + 1, {"Training methods": section})
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each `<!-- generated: ... -->` line with its table."""

    def replace(match: re.Match) -> str:
        kind, argument = match.group(1), match.group(2)
        if kind == "fields" and argument:
            return fields_of(argument)
        if kind in GENERATORS:
            return GENERATORS[kind]()
        log.warning(f"{page.file.src_path}: unknown generated table {kind!r}")
        return match.group(0)

    return MARKER.sub(replace, markdown)
