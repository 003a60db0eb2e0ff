"""An adapter run's files, with Hugging Face's `peft`: what a checkpoint keeps of the adapter
(its config, naming its base, and the names PEFT gives its weights), the base's fingerprint (a
base replaced on disk is refused), and the PEFT directories an export writes (an adapter, or the
base with the adapter folded in). The one other module that imports `peft` beside
`framework.integrations.peft`, which makes and describes adapted models.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from framework.errors import ConfigError
from framework.integrations.peft import base_name, is_adapted, quietly, require, trainable_counts


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

    from peft import get_peft_model_state_dict

    config = copy.copy(next(iter(model.peft_config.values())))
    base = config.base_model_name_or_path
    if base and Path(base).is_dir():
        config.base_model_name_or_path = str(Path(base).resolve())
    config.save_pretrained(str(path / ADAPTER_DIR))
    names = list(model.state_dict())  # names only: under ZeRO-3 the tensors are empty partitions
    with quietly():
        chosen = get_peft_model_state_dict(
            model, state_dict={n: torch.tensor(i) for i, n in enumerate(names)}
        )
    mapping = {key: names[int(index)] for key, index in chosen.items()}
    (path / ADAPTER_DIR / WEIGHTS_MAP).write_text(json.dumps(mapping, indent=1))


def save_adapter_weights(path: Path, state: dict[str, torch.Tensor], out: Path) -> Path:
    """A PEFT adapter directory from checkpoint `path`'s adapter config and its weights `state`
    (the consolidated state dict of the adapted model), without building the model: for an
    adapter on any torch module (`PeftModel.from_pretrained(module, OUT)` loads it)."""
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
    require()
    from peft import PeftConfig

    return PeftConfig.from_pretrained(str(path / ADAPTER_DIR))


def rebuilt(base: nn.Module, config: Any, state: dict[str, torch.Tensor]) -> Any:
    """`base` adapted with `config`, holding the weights of `state` (a checkpoint's state dict of
    the adapted model: what trained, or everything): every key must fit, and every trained one
    be there."""
    from peft import get_peft_model

    with quietly():
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
