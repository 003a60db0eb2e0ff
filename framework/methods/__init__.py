"""Training methods, one module each: its options dataclass, its loss or step, its metrics
(TRL's names), its checkpoint state and its reference policy, found by name.

    Engine(model, optimizer=..., train_step=DPO(beta=0.1))        # from Python
    python train.py ... +objective=dpo objective.beta=0.1         # from the CLI: the same object

* `base`        the protocol the engine calls (`Method`) and the registry (`method_class`);
* `tokens`      what token-scoring methods share: their options, answers' log-probabilities, a
                window meter;
* `chunked`     the output head applied in chunks of the counted positions, never the batch's logits;
* `pairs`       what preference methods share: pairs batches, TRL's pair metrics;
* `reference`   a frozen reference policy (adapters off, or a copy partitioned like the policy);
* `precompute`  reference log-probabilities computed once, kept with the data;
* `rewards`     reward functions of online methods (TRL's signature), checked where they run;
* `rollout`     sampling completions behind one interface, exact per completion; advantages;
* `scoring`     one rollout scored over every rank: rewards, advantages, the step's metrics;
* `sft`, `dpo`, `simpo`, `orpo`, `grpo`: one method each (`name`: `+objective=NAME`).

A method of the user's own is a `Method` subclass in the user's module, named by its import
path (`+objective=custom objective.name=my_pkg.ToyLoss`) or handed to the Engine as it is.

Rule: imports the packages below it (`engine` included), never `recipe` or `cli`; a new method
is a new module here, registered by its `name`, and nothing else changes.
"""

import importlib
import importlib.util
from typing import Any

from framework.methods.base import Method, method_class, registered

__all__ = ["Method", "method_class", "registered"]


def __getattr__(name: str) -> Any:
    """A method's class or options class by its class name (`from framework.methods import DPO,
    DPOConfig`), found in the registry: a new method is importable from here without an edit.
    A submodule's name is the submodule (`from framework.methods import chunked` inside a method
    module imports it, not every method, which would import that module half-made)."""
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    for cls in registered().values():
        for found in (cls, cls.Config):
            if found.__name__ == name:
                return found
    raise AttributeError(f"module 'framework.methods' has no attribute {name!r}")
