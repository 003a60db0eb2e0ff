"""Building a model so that under ZeRO-3 it starts from exactly the weights it would have unsharded.

Under ZeRO-3 a model can be built two ways (`strategy.sharding.init`):

* **whole**: built as usual on every rank, then partitioned when DeepSpeed's engine is built. Any
  initialisation code works, and the weights are the same as under ZeRO-0 with the same seed.
  Needs the whole model in one rank's memory for a moment.
* **partitioned**: born inside `deepspeed.zero.Init`, never whole on one rank: for a model that
  does not fit. A module's parameters are partitioned as soon as its `__init__` returns, so code
  that initialises them later by hand (a loop over `self.modules()` calling `nn.init`, as
  torchvision and timm do) would write into empty shards: that is detected and refused. Hugging
  Face models take transformers' own ZeRO-3 path (`HfDeepSpeedConfig`), which initialises and
  loads them correctly.

`auto` (the default) builds whole when the model fits comfortably (its fp32 weights, for every
process on the machine, in half the free host memory, and on a GPU in half its free memory),
partitioned otherwise. Its size comes from a build on the meta device; a model whose `__init__`
cannot run there (it reads a tensor's value, e.g. timm's `x.item()` drop-path rates) is built
whole. The choice is one line of the run's output. The model's class is imported
before `zero.Init` is entered (transformers' first import inside it fails).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_object, instantiate

from framework.backend.ds_config import zero_init_config
from framework.backend.runtime import Runtime
from framework.errors import ConfigError
from framework.integrations import hf
from framework.integrations.hf_models import BUILDS_HF_MODELS
from framework.process.context import ProcessContext

INIT_MODES = ("auto", "whole", "partitioned")
_NN_INIT = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip


def _target(node: Any) -> Any:
    """The object `_target_` names, imported now (outside any `zero.Init`)."""
    try:
        return get_object(str(node._target_))
    except Exception:  # noqa: BLE001 - instantiate reports it with the key
        return None


def meta_model(node: Any) -> Any:
    """The model built on the meta device (shapes only: no memory, the random generators
    untouched): the model itself, or for a `path` directory of a Hugging Face model, its
    config.json's architecture (never read from the weight files)."""
    path = node.get("path") if hasattr(node, "get") else None
    config_file = Path(str(path)) / "config.json" if path else None
    with torch.random.fork_rng(devices=[]), torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if config_file is not None and config_file.is_file():
            return hf.model_from_config_dir(config_file.parent, strict=False)
        return instantiate(node)


def count_parameters(node: Any) -> int:
    """Parameters the model will have (`meta_model`)."""
    return sum(p.numel() for p in meta_model(node).parameters())


def _free_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def fits_whole(parameters: int, process: ProcessContext) -> bool:
    """Whether every process of this machine can hold the whole fp32 model for a moment."""
    need = 4 * parameters
    if need * process.local_world_size > _free_host_bytes() / 2:
        return False
    if process.cuda:
        return need <= torch.cuda.mem_get_info(process.device)[0] / 2
    return True


# In-place writes an initialisation makes (directly, `p.data.normal_()`, or through an init
# function kept from before any patching, as transformers keeps torch.nn.init's).
_INIT_WRITES = frozenset(
    ("normal_", "uniform_", "zero_", "fill_", "copy_", "exponential_", "log_normal_", "cauchy_", "geometric_")
)


class _EmptyWrites(torch.overrides.TorchFunctionMode):
    """Records initialising writes into floating tensors with no elements: under zero.Init, a
    parameter whose module was already built holds no elements (they live in its partition)."""

    def __init__(self, lost: list[str]):
        super().__init__()
        self.lost = lost

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _INIT_WRITES and args and isinstance(args[0], torch.Tensor):
            if args[0].numel() == 0 and args[0].is_floating_point():
                self.lost.append(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _lost_initialisations() -> Iterator[list[str]]:
    """Record `torch.nn.init` calls on empty (partitioned) parameters while the block runs."""
    lost: list[str] = []
    originals = {name: getattr(torch.nn.init, name) for name in _NN_INIT if hasattr(torch.nn.init, name)}

    def watch(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.numel() == 0 and hasattr(tensor, "ds_id"):
                lost.append(f"torch.nn.init.{name}")
            return fn(tensor, *args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(torch.nn.init, name, watch(name, fn))
    try:
        with warnings.catch_warnings(), _EmptyWrites(lost):  # we say what it means instead
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
            yield lost
    finally:
        for name, fn in originals.items():
            setattr(torch.nn.init, name, fn)


def _partitioned(node: Any, runtime: Runtime, target: Any) -> Any:
    """Build inside zero.Init: transformers' own path for its models, ours for the rest."""
    if hf.is_hf_model_class(target) or getattr(target, BUILDS_HF_MODELS, False):
        runtime.start()
        with hf.zero3_construction(zero_init_config(runtime.strategy, runtime.layout_for_init())):
            if hf.is_hf_model_class(target):  # a model class with its config: transformers' from_config
                kwargs = {
                    k: instantiate(v) if hasattr(v, "_target_") else v
                    for k, v in node.items()
                    if k != "_target_"
                }
                return target._from_config(kwargs.pop("config"), **kwargs)
            return instantiate(node)
    with runtime.init_context(), _lost_initialisations() as lost:
        model = instantiate(node)
    if lost:
        raise ConfigError(
            f"{type(model).__name__} initialises its weights after building its sub-modules ({lost[0]} on "
            "parameters that ZeRO-3 had already partitioned), so built partitioned it would "
            "silently not get them: build it whole (strategy.sharding.init=whole) or initialise through "
            "self.apply(fn)"
        )
    return model


def build_model(node: Any, runtime: Runtime) -> Any:
    """The model `node` describes, built the way `strategy.sharding.init` says (see the module doc)."""
    target = _target(node)
    strategy = runtime.strategy
    if strategy.sharding.stage != 3 or strategy.uses_pipeline:
        return instantiate(node)
    mode, main = strategy.sharding.init, runtime.mesh.rank == 0
    if mode != "auto":
        whole = mode == "whole"
        _announce(main, whole, mode, "asked for")
        return instantiate(node) if whole else _partitioned(node, runtime, target)
    try:
        parameters = count_parameters(node)
    except Exception as exc:  # noqa: BLE001 - e.g. .item() in __init__; a real error recurs below
        model = instantiate(node)  # what auto does with a model that fits: built whole
        parameters = sum(p.numel() for p in model.parameters())
        _announce(
            main,
            True,
            mode,
            f"its size could not be counted on the meta device: {_first_line(exc)}",
            parameters,
        )
        return model
    whole = fits_whole(parameters, runtime.process)
    _announce(
        main, whole, mode, "fits in one rank's memory" if whole else "too large for one rank", parameters
    )
    return instantiate(node) if whole else _partitioned(node, runtime, target)


def _first_line(exc: BaseException) -> str:
    """The first line of what went wrong at the bottom (Hydra wraps it in its own exception)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _announce(main: bool, whole: bool, mode: str, why: str, parameters: int = 0) -> None:
    """The one line saying how the model is built (rank 0, `main`, says it)."""
    if not main:
        return
    count = ""
    if parameters:
        count = f"{parameters / 1e6:,.1f} M" if parameters >= 10**6 else f"{parameters:,}"
        count += " parameters, "
    how = (
        "built whole, then partitioned by DeepSpeed"
        if whole
        else "built partitioned inside deepspeed.zero.Init"
    )
    print(f"model: {count}{how} (ZeRO-3, strategy.sharding.init={mode}: {why})", flush=True)
