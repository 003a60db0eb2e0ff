"""What the engine asks of a training method, and how methods are found by name.

A method is a training step with a name and an options dataclass:

    step(engine, batch) -> loss              or, with `items`: step(engine, batch, weight) -> loss
    step(engine, dataloader_iter) -> {"loss"}    a step that pulls its batches and steps itself (GRPO)

and what the loop calls on it when it is there (the `Method` base class gives each a default):

* `attach(engine)`: once, when an `Engine` takes the method, before DeepSpeed is built (DPO's
  frozen reference copy is made here);
* `prepare_data(engine, data, batch_size, collate_fn) -> data`: at the start of `fit`, for the
  training and the validation data, with DeepSpeed built and before a resume loads the policy
  (DPO's `precompute_reference`);
* `weights_loaded(engine)`: after `Engine.load` put weights into the model (`trainer.init_from`:
  DPO's frozen reference follows them);
* `items(batch) -> Tensor | None`: what the loss averages over, counted over the whole global
  batch by the framework before the step (`framework.engine.items`); the step then gets
  `weight`, its micro-batch's share, so that a token mean is exact on every layout;
* `rows_per_batch(batch_size) -> rows`: how many data rows a global batch of `batch_size` holds,
  when the method counts its batch in other units (GRPO: completions, G per prompt row);
* `updates_per_batch() -> n`: optimizer steps a step call takes per global batch (GRPO's
  `num_iterations`), so the run's plan counts them;
* `eval_step(engine, batch) -> loss`: validation (an Engine given the method evaluates with it);
* `step_logs(device)` / `eval_logs(device)`: metrics since the last logging point / of a
  validation, under TRL's names (collective: every rank calls them);
* `step_state()` / `load_step_state(states, device)`: what a checkpoint keeps of them;
* `step_samples() -> records`: what a step sampled, for the run's completions file (GRPO).

Methods register by being a subclass with a `name`, in a module of `framework.methods`; a
method of the user's own is found by its import path (`my_pkg.methods.ToyLoss`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
from typing import Any, ClassVar

import torch

from framework.errors import ConfigError


@dataclasses.dataclass
class NoOptions:
    """The options of a method that has none."""


class Method:
    """Base class of training methods (see the module doc). A subclass sets `name` (the registry
    name, `+objective=NAME`) and `Config` (its options dataclass); `Method(**options)` or
    `Method(Config(...))` make one, the options checked by the dataclass."""

    name: ClassVar[str] = ""
    Config: ClassVar[type] = NoOptions
    # a method's step asks no stop on some ranks only (see framework.observe.callbacks)
    stops_alike: ClassVar[bool] = True

    def __init__(self, config: Any = None, **options: Any):
        self.config = options_of(type(self), config, options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"

    # ------------------------------------------------------------------ the step and its hooks
    def __call__(self, engine: Any, batch: Any, weight: Any = None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} defines no training step (__call__)")

    def eval_step(self, engine: Any, batch: Any) -> torch.Tensor:
        """The validation loss of a batch (default: the training loss, unweighted)."""
        return self(engine, batch)

    def attach(self, engine: Any) -> None:
        """Called once by the Engine that takes this method, before DeepSpeed is built."""

    def prepare_data(self, engine: Any, data: Any, batch_size: int, collate_fn: Any) -> Any:
        """The data `fit` trains (or validates) on; default: `data` as it is."""
        return data

    def weights_loaded(self, engine: Any) -> None:
        """Called after `Engine.load` put weights (not a checkpoint) into the model."""

    def step_logs(self, device: torch.device | None = None) -> dict[str, float]:
        """Metrics of the training steps since the last logging point (collective)."""
        return {}

    def eval_logs(self, device: torch.device | None = None) -> dict[str, float]:
        """Metrics of the validation just run (collective)."""
        return {}


def options_of(cls: type[Method], config: Any, options: dict[str, Any]) -> Any:
    """`cls.Config` from a config object and/or keyword options; an unknown option is one line
    naming the nearest valid one."""
    schema = cls.Config
    valid = [f.name for f in dataclasses.fields(schema)]
    for key in options:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            reason = f"no such option; {hint}valid: {', '.join(valid) or 'none'}"
            raise ConfigError.about(cls.__name__, key, options[key], reason)
    if config is None:
        return schema(**options)
    if not isinstance(config, schema):
        raise ConfigError(
            f"{cls.__name__}(config=...) takes a {schema.__name__}, got {type(config).__name__}"
        )
    return dataclasses.replace(config, **options) if options else config  # type: ignore[type-var]


# ----------------------------------------------------------------------------------- registry


def _subclasses(cls: type[Method]) -> list[type[Method]]:
    out: list[type[Method]] = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def registered() -> dict[str, type[Method]]:
    """Every method of `framework.methods` by name (each module of the package imported)."""
    import framework.methods as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    return {
        sub.name: sub
        for sub in _subclasses(Method)
        if sub.name and sub.__module__.startswith(f"{package.__name__}.")
    }


def method_class(name: str) -> type[Method]:
    """The method called `name` (`dpo`), or the `Method` subclass at an import path
    (`my_pkg.methods.ToyLoss`)."""
    methods = registered()
    if name in methods:
        return methods[name]
    if "." not in name:
        close = difflib.get_close_matches(name, list(methods), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(
            f"no training method called {name!r}; {hint}the methods: {', '.join(sorted(methods))}, or the "
            "import path of a Method subclass of your own (my_pkg.module.MyMethod)"
        )
    module_name, _, attr = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"the method {name} cannot be imported: {exc}") from None
    if not (isinstance(found, type) and issubclass(found, Method)):
        raise ConfigError(f"{name} is not a framework.methods.Method subclass")
    return found
