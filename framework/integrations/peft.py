"""Adapters with Hugging Face's `peft` (with `framework.integrations.peft_files`, the modules
that import it).

* What a model is: `is_adapted` (a `peft` wrapper), `base_model` (the model inside it).
* Making one: `AdapterConfig` (the adapter's options: `adapter.*` on the command line, as a
  `peft.LoraConfig` by `peft_config()`), `adapt` (wrap a model with a config, a causal LM as
  `CAUSAL_LM`), `describe` (the console line saying what trains), `adapters_disabled` (the base
  model for a block: a method's reference without a second copy), `head_terms` (an output head
  as its plain layer and its LoRA adapters' low-rank terms, for a loss that applies it itself).
* Files (`peft_files`): what a checkpoint keeps of the adapter (its config, naming its base;
  the base's fingerprint), the PEFT directories an export writes (`save_adapter`, `merged`).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from framework.errors import ConfigError

ALL_LINEAR = "all-linear"  # peft's choice of every linear layer but the output head


def installed() -> bool:
    """True when `peft` can be imported."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    return True


def require() -> None:
    if not installed():
        raise ConfigError(
            "adapters need the peft library: pip install 'hydraspeed[adapter]' (or pip install peft)"
        )


def is_adapted(module: Any) -> bool:
    """True for a model wrapped by `peft` (`get_peft_model`, `PeftModel.from_pretrained`)."""
    if "peft" not in sys.modules:  # nobody made one without importing peft
        return False
    from peft import PeftModel

    return isinstance(module, PeftModel)


def base_model(module: Any) -> Any:
    """The model inside a `peft` wrapper (the user's transformers model); `module` otherwise."""
    return module.get_base_model() if is_adapted(module) else module


@dataclass
class AdapterConfig:
    """LoRA adapters on a frozen model, with `peft` (`+adapter=lora`, `Engine(adapter=...)`):
    only the adapters train (`peft_config()` is the `peft.LoraConfig` it means)."""

    r: int = 8  # rank of each adapter's two matrices
    alpha: int = 16  # scaling numerator: the adapter's output is multiplied by alpha / r
    dropout: float = 0.05  # dropout on the adapter's input (0: the update is deterministic)
    target_modules: Any = (
        ALL_LINEAR  # module names to adapt, or all-linear: every linear layer but the output head
    )
    modules_to_save: list[str] | None = None  # modules trained whole beside the adapters (e.g. [lm_head])
    use_dora: bool = False  # DoRA: weight-decomposed adapters (a magnitude per output feature)

    def peft_config(self) -> Any:
        """The `peft.LoraConfig` of these options."""
        require()
        from peft import LoraConfig

        targets = self.target_modules
        targets = targets if isinstance(targets, str) else [str(t) for t in targets]
        saved = None if self.modules_to_save is None else [str(m) for m in self.modules_to_save]
        return LoraConfig(
            r=int(self.r),
            lora_alpha=int(self.alpha),
            lora_dropout=float(self.dropout),
            target_modules=targets,
            modules_to_save=saved,
            use_dora=bool(self.use_dora),
        )


def peft_config(adapter: Any) -> Any:
    """A `peft` config from `adapter`: an `AdapterConfig`, a dict of its options, or a `peft`
    config as it is (None: None)."""
    if isinstance(adapter, AdapterConfig):
        return adapter.peft_config()
    if isinstance(adapter, dict):
        return AdapterConfig(**adapter).peft_config()
    return adapter


@contextlib.contextmanager
def adapters_disabled(module: Any) -> Iterator[None]:
    """The block runs `module` (a `peft` model) as its base model: adapters off, back on after
    (`PeftModel.disable_adapter()`, as TRL's DPOTrainer takes its reference: no second copy)."""
    with module.disable_adapter():
        yield


def _running(wrapper: Any) -> Any:
    """The module a `ModulesToSaveWrapper` runs now: its trained copy, or the original with the
    adapters off (as its forward chooses)."""
    active = list(getattr(wrapper, "active_adapters", None) or [])
    if wrapper.disable_adapters or not active or any(a not in wrapper.modules_to_save for a in active):
        return wrapper.original_module
    return wrapper.modules_to_save[active[0]]


def head_terms(head: nn.Module) -> tuple[nn.Module, list[tuple[Any, torch.Tensor]]] | None:
    """An output head as (the plain layer it applies, [(down, up)] of its active LoRA adapters),
    so that head(x) = layer(x) + sum of F.linear(down(x), up): down(x) is the adapter's scaling
    times lora_A(dropout(x)), up lora_B's weight. A head that is not a `peft` layer is itself with
    no adapters; a `modules_to_save` copy is the copy the wrapper runs; adapters off or merged
    leave the base layer alone. None where the head computes anything else (DoRA and other LoRA
    variants, a bias on lora_B, adapters off over merged weights, other `peft` layers)."""
    if "peft" not in sys.modules:
        return head, []
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    if isinstance(head, ModulesToSaveWrapper):
        return head_terms(_running(head))
    if not isinstance(head, BaseTunerLayer):
        return head, []
    if not isinstance(head, LoraLinear) or (head.disable_adapters and head.merged):
        return None
    if head.disable_adapters or head.merged:
        return head.get_base_layer(), []
    terms: list[tuple[Any, torch.Tensor]] = []
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        if (
            name in getattr(head, "lora_variant", {})
            or head.use_dora.get(name)
            or head.lora_B[name].bias is not None
        ):
            return None
        down = functools.partial(_down, head.lora_A[name], head.lora_dropout[name], head.scaling[name])
        terms.append((down, head.lora_B[name].weight))
    return head.get_base_layer(), terms


def _down(a: nn.Linear, dropout: nn.Module, scale: float, x: torch.Tensor) -> torch.Tensor:
    """An adapter's input side as its layer computes it: scale x lora_A(dropout(x))."""
    return a(dropout(x.to(a.weight.dtype))) * scale


def adapt(model: nn.Module, config: Any, causal_lm: bool = False) -> nn.Module:
    """`model` wrapped with the adapter `config` (a `peft` config; `causal_lm`: as a causal LM, so
    the wrapper passes `labels=` through and exports as one). Only the adapter trains."""
    require()
    import copy

    from peft import get_peft_model

    if is_adapted(model):
        raise ConfigError(
            "the model already carries an adapter: pass it without adapter=, or the base model with it"
        )
    if causal_lm and getattr(config, "task_type", None) is None:
        config = copy.copy(config)
        config.task_type = "CAUSAL_LM"
    _check_saved(model, getattr(config, "modules_to_save", None))
    try:
        with quietly():
            return get_peft_model(model, config)
    except ValueError as exc:  # e.g. a target module the model does not have
        raise ConfigError(f"adapter: {str(exc).splitlines()[0]}") from None


@contextlib.contextmanager
def quietly() -> Iterator[None]:
    """peft asks a transformers model `is_gradient_checkpointing`, which transformers 5 deprecates
    with a FutureWarning on every call: a warning about peft's code, not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def _check_saved(model: nn.Module, names: Any) -> None:
    """Every `modules_to_save` entry names a module of `model` (peft's rule: a module whose name
    ends with it), or one line: peft would train as if it did, with nothing copied or trained."""
    if not names:
        return
    found = [key for key, _ in model.named_modules() if key]
    missing = [str(name) for name in names if not any(key.endswith(str(name)) for key in found)]
    if not missing:
        return
    last = sorted({key.rsplit(".", 1)[-1] for key in found if not key.rsplit(".", 1)[-1].isdigit()})
    near = sorted({m for name in missing for m in difflib.get_close_matches(name, last, n=2)}) or last[:6]
    raise ConfigError(
        f"adapter: modules_to_save {missing} not found in the base model ({type(model).__name__}); "
        f"name modules it has (its module names end with them), e.g. {', '.join(near)}"
    )


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3: the whole size of a partitioned weight


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter elements of `model`, whole sizes under ZeRO-3."""
    params = list(model.parameters())
    return sum(_numel(p) for p in params if p.requires_grad), sum(_numel(p) for p in params)


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f} M" if n >= 10**5 else f"{n:,}"


def describe(model: Any) -> str:
    """'LoRA r=8 on 14 modules: 0.4 M of 25 M parameters trainable' for an adapted model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    config = next(iter(model.peft_config.values()))
    kind = str(getattr(config.peft_type, "value", config.peft_type)).replace("LORA", "LoRA")
    kind = "DoRA" if getattr(config, "use_dora", False) else kind
    layers = sum(isinstance(m, BaseTunerLayer) for m in model.modules())
    trainable, total = trainable_counts(model)
    rank = f" r={config.r}" if hasattr(config, "r") else ""
    return (
        f"{kind}{rank} on {layers} modules: {_millions(trainable)} of {_millions(total)} parameters trainable"
    )


def base_name(model: Any) -> str | None:
    """Where the adapted model's base came from (`base_model_name_or_path`: its directory), if known."""
    config = next(iter(model.peft_config.values()))
    return getattr(config, "base_model_name_or_path", None) or None
