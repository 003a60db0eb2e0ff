"""Adapters with Hugging Face's `peft`: the one module that imports it.

* What a model is: `is_adapted` (a `peft` wrapper), `base_model` (the model inside it).
* Making one: `AdapterConfig` (the adapter's options: `adapter.*` on the command line, as a
  `peft.LoraConfig` by `peft_config()`), `adapt` (wrap a model with a config, a causal LM as
  `CAUSAL_LM`), `describe` (the console line saying what trains), `adapters_disabled` (the base
  model for a block: a method's reference without a second copy).
* Files: `save_config` / `load_config` (the adapter's config kept in a checkpoint, which names
  the base model it was trained from), `save_adapter` (a PEFT adapter directory from a state
  dict: `PeftModel.from_pretrained(base, DIR)` loads it), `merged` (the base with the adapter's
  weights folded in).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
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


def _require() -> None:
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
        _require()
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


def adapt(model: nn.Module, config: Any, causal_lm: bool = False) -> nn.Module:
    """`model` wrapped with the adapter `config` (a `peft` config; `causal_lm`: as a causal LM, so
    the wrapper passes `labels=` through and exports as one). Only the adapter trains."""
    _require()
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
        with _quiet():
            return get_peft_model(model, config)
    except ValueError as exc:  # e.g. a target module the model does not have
        raise ConfigError(f"adapter: {str(exc).splitlines()[0]}") from None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
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


def describe_checkpoint(size: int, model: Any) -> str:
    """'checkpoint: 0.20 MB, what trains and its optimizer states (9,200 of 40,016 parameters:
    23% of a full-training checkpoint's), base DIR' for an adapter run's checkpoint of `size` bytes."""
    trainable, total = trainable_counts(model)
    return (
        f"checkpoint: {size / 2**20:.2f} MB, what trains and its optimizer states ({trainable:,} of {total:,} "
        f"parameters: {100 * trainable / max(total, 1):.0f}% of a full-training checkpoint's), base "
        f"{base_name(model) or 'built from its config'}"
    )


ADAPTER_DIR = "adapter"  # in a checkpoint: adapter_config.json of the run's adapter


WEIGHTS_MAP = "weights_map.json"  # in ADAPTER_DIR: {name in a PEFT adapter file: name in the model}


def save_config(model: Any, path: Path) -> None:
    """The adapter's config (`adapter_config.json`, naming its base model: a directory by its
    absolute path, so an export from anywhere finds it) under `path/adapter`, with the names its
    weights have in a PEFT adapter file (`WEIGHTS_MAP`, as peft itself names them), so that
    `save_adapter_weights` needs no model to write one."""
    import copy
    import json

    from peft import get_peft_model_state_dict

    config = copy.copy(next(iter(model.peft_config.values())))
    base = config.base_model_name_or_path
    if base and Path(base).is_dir():
        config.base_model_name_or_path = str(Path(base).resolve())
    config.save_pretrained(str(path / ADAPTER_DIR))
    names = list(model.state_dict())  # names only: under ZeRO-3 the tensors are empty partitions
    with _quiet():
        chosen = get_peft_model_state_dict(
            model, state_dict={n: torch.tensor(i) for i, n in enumerate(names)}
        )
    mapping = {key: names[int(index)] for key, index in chosen.items()}
    (path / ADAPTER_DIR / WEIGHTS_MAP).write_text(json.dumps(mapping, indent=1))


def save_adapter_weights(path: Path, state: dict[str, torch.Tensor], out: Path) -> Path:
    """A PEFT adapter directory from checkpoint `path`'s adapter config and its weights `state`
    (the consolidated state dict of the adapted model), without building the model: for an
    adapter on any torch module (`PeftModel.from_pretrained(module, OUT)` loads it)."""
    import json
    import shutil

    from safetensors.torch import save_file

    names = path / ADAPTER_DIR / WEIGHTS_MAP
    if not names.is_file():
        raise ConfigError(
            f"{path} records no adapter weight names ({ADAPTER_DIR}/{WEIGHTS_MAP}): save it again"
        )
    mapping = json.loads(names.read_text())
    missing = [name for name in mapping.values() if name not in state]
    if missing or not mapping:
        raise ConfigError(f"{path} lacks the adapter's weights ({', '.join(missing[:3]) or 'none recorded'})")
    out.mkdir(parents=True, exist_ok=True)
    weights = {key: state[name].detach().contiguous().clone() for key, name in mapping.items()}
    save_file(weights, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(path / ADAPTER_DIR / "adapter_config.json", out / "adapter_config.json")
    return out


_fingerprints: dict[Any, str] = {}  # the files' names, sizes and times -> their fingerprint


def fingerprint(directory: Path) -> str | None:
    """SHA-256 over the weight files of a `save_pretrained` directory (`*.safetensors`, `*.bin`:
    each one's name and bytes, in name order); None when it holds none. Hashed once per process
    while no file changes (name, size, modification time)."""
    files = sorted(
        f for pattern in ("*.safetensors", "*.bin") for f in Path(directory).glob(pattern) if f.is_file()
    )
    stamp = tuple((f.name, (st := f.stat()).st_size, st.st_mtime_ns) for f in files)
    if not files:
        return None
    if (Path(directory).resolve(), stamp) not in _fingerprints:
        digest = hashlib.sha256()
        for file in files:
            digest.update(file.name.encode() + b"\0")
            with open(file, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    digest.update(block)
        _fingerprints[(Path(directory).resolve(), stamp)] = digest.hexdigest()
    return _fingerprints[(Path(directory).resolve(), stamp)]


def hyperparameters(model: Any) -> dict[str, Any] | None:
    """What an adapted model's adapter computes with beside its weights (`lora_alpha` scales its
    output by alpha / r, `use_dora` decomposes it, `lora_dropout` drops its input in training);
    None for a model without an adapter."""
    if not is_adapted(model):
        return None
    config = next(iter(model.peft_config.values()))
    return {key: getattr(config, key, None) for key in ("lora_alpha", "use_dora", "lora_dropout")}


def base_record(model: Any) -> dict[str, str] | None:
    """Where an adapted model's base weights came from and their `fingerprint` (for a checkpoint's
    metadata); None for a base that no directory holds (built in code)."""
    where = base_name(model)
    found = fingerprint(Path(where)) if where and Path(where).is_dir() else None
    return {"path": str(Path(str(where)).resolve()), "sha256": found} if found else None


def other_base(recorded: dict[str, str] | None, directory: Path) -> str | None:
    """Why the base in `directory` is not the one a checkpoint's adapter trained on (`recorded`:
    `base_record` at the save), in words; None when it is, or nothing was recorded."""
    if not recorded:
        return None
    found = fingerprint(directory) if directory.is_dir() else None
    if found == recorded["sha256"]:
        return None
    what = "holds other weights" if found else "holds no weight files"
    return (
        f"the base model {directory} {what} than the one the adapter was trained on ({recorded['path']} at the "
        f"save; SHA-256 of its weight files {recorded['sha256'][:12]}, here {(found or 'none')[:12]})"
    )


def load_config(path: Path) -> Any | None:
    """The adapter config a checkpoint keeps (`save_config`), or None for a full-training one."""
    if not (path / ADAPTER_DIR / "adapter_config.json").is_file():
        return None
    _require()
    from peft import PeftConfig

    return PeftConfig.from_pretrained(str(path / ADAPTER_DIR))


def rebuilt(base: nn.Module, config: Any, state: dict[str, torch.Tensor]) -> Any:
    """`base` adapted with `config`, holding the weights of `state` (a checkpoint's state dict of
    the adapted model: what trained, or everything): every key must fit, and every trained one
    be there."""
    from peft import get_peft_model

    with _quiet():
        model = get_peft_model(base, config)
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    wrong = [
        (k, tuple(v.shape), shapes[k])
        for k, v in state.items()
        if k in shapes and tuple(v.shape) != shapes[k]
    ]
    if wrong:  # torch would raise a page of "size mismatch for ..." lines
        name, there, here = wrong[0]
        raise ConfigError(
            f"the checkpoint's weights do not fit the adapted {type(base).__name__}: {name} is {list(there)} in "
            f"the checkpoint, {list(here)} here ({len(wrong)} such): give the base model the run trained from"
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    if unexpected or trained & set(missing):
        raise ConfigError(
            f"the checkpoint's weights do not fit the adapted {type(base).__name__} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    return model


def save_adapter(model: Any, out: Path) -> Path:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) of `model`;
    an adapter without weights is refused (never an empty file)."""
    from peft import get_peft_model_state_dict

    if not get_peft_model_state_dict(model):
        raise ConfigError("the adapter holds no weights: nothing to export")
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def merged(model: Any) -> Any:
    """The base model with the adapter's weights folded in (a plain transformers model)."""
    return model.merge_and_unload()
