"""The one place a model is made, for the CLI and the Python API alike: build -> adapt -> partition.

    model = construct.build_model(lambda: AutoModelForCausalLM.from_pretrained(DIR), runtime,
                                  adapter=peft.LoraConfig(r=8), transformers=True)

* **build**: `make()`, a zero-argument factory (the CLI passes `partial(instantiate, node)`).
  Under ZeRO-3 a model can be built two ways (`strategy.sharding.init`): **whole**, as usual on
  every rank (any initialisation code works; the weights are those of ZeRO-0 with the same
  seed; the whole model sits in one rank's memory for a moment), or **partitioned**, born
  inside `deepspeed.zero.Init`, never whole on one rank. A module's parameters are partitioned
  as soon as its `__init__` returns, so code that initialises them later by hand (a loop over
  `self.modules()` calling `nn.init`, as torchvision and timm do) would write into empty
  shards: that is detected and refused. A transformers model (`transformers=True`) takes transformers'
  own ZeRO-3 path (`HfDeepSpeedConfig`), which initialises and loads it correctly. `auto` (the
  default) builds whole when the model fits comfortably (its fp32 weights, for every process on
  the machine, in half the free host memory, and on a GPU in half its free memory),
  partitioned otherwise; its size comes from `meta()`, a build on the meta device (default:
  `make()` there). A model that cannot be built on the meta device is built whole. The choice
  is one line of the run's output.
* **adapt**: with an `adapter` (a `peft` config), the model is wrapped by `peft`: only the
  adapter trains. A model the user wrapped already passes as it is. Either way the strategy is
  checked against what adapters support, one line per refusal (`check_adapted`). A Hugging Face
  model's attention then keeps packed documents apart however it is called
  (`framework.integrations.packed`).
* **partition**: DeepSpeed's engine (`Runtime.initialize`) partitions what is still whole (a
  whole-built model, the adapter's own weights) and hands the optimizer only what trains.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from framework.backend.ds_config import zero_init_config
from framework.backend.runtime import Runtime
from framework.errors import ConfigError
from framework.integrations import hf, packed, peft
from framework.process.context import ProcessContext

INIT_MODES = ("auto", "whole", "partitioned")
_NN_INIT = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


def build_model(
    make: Callable[[], nn.Module],
    runtime: Runtime,
    *,
    adapter: Any = None,
    meta: Callable[[], nn.Module] | None = None,
    transformers: bool = False,
) -> nn.Module:
    """The model `make` builds, built as `strategy.sharding.init` says, then adapted (see the
    module doc). `meta`: the model on the meta device, for its size; `transformers`: `make`
    builds a transformers model (its own ZeRO-3 path when partitioned)."""
    if adapter is not None:
        check_adapted(runtime.strategy)  # before anything is built
    model = _built(make, runtime, meta or functools.partial(on_meta, make), transformers)
    return adapt(model, adapter, runtime.strategy)


def on_meta(make: Callable[[], nn.Module]) -> nn.Module:
    """`make()` on the meta device: shapes only, no memory, the random generators untouched."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


def adapt(model: nn.Module, adapter: Any, strategy: Any) -> nn.Module:
    """`model` wrapped with `adapter` (an `AdapterConfig`, its options as a dict, or a `peft`
    config; None: as it is); an adapted model's strategy checked (`check_adapted`). The runtime
    says what trains when it starts."""
    adapter = peft.peft_config(adapter)
    if adapter is not None:
        if getattr(adapter, "modules_to_save", None) and any(hasattr(p, "ds_id") for p in model.parameters()):
            raise ConfigError(
                "adapter.modules_to_save copies whole modules, which a model built partitioned does not have "
                "(DeepSpeed issue 7669): build it whole (strategy.sharding.init=whole)"
            )
        model = peft.adapt(model, adapter, causal_lm=hf.predicts_next_token(model))
    if peft.is_adapted(model):
        check_adapted(strategy)
    return packed.keep_documents_apart(model)


def check_adapted(strategy: Any) -> None:
    """Adapters train under ZeRO 0-3 (offload and recompute included) and data parallelism; the
    other parallelisms are refused, one line each."""
    refused = (
        (strategy.uses_pipeline, "strategy.pipeline.stages=1", "the pipeline"),
        (strategy.tensor_parallel.degree > 1, "strategy.tensor_parallel.degree=1", "tensor parallelism"),
        (
            strategy.sequence_parallel.degree > 1,
            "strategy.sequence_parallel.degree=1",
            "sequence parallelism",
        ),
        (strategy.expert_parallel.degree > 1, "strategy.expert_parallel.degree=1", "expert parallelism"),
    )
    for on, fix, what in refused:
        if on:
            raise ConfigError(
                f"adapters do not train under {what} yet: set {fix} (ZeRO-3 over data-parallel ranks "
                "partitions the frozen base instead)"
            )


def count_parameters(meta: Callable[[], nn.Module]) -> int:
    """Parameters the model `meta()` builds on the meta device will have."""
    return sum(p.numel() for p in meta().parameters())


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


def _partitioned(make: Callable[[], nn.Module], runtime: Runtime, transformers: bool) -> nn.Module:
    """Build inside zero.Init: transformers' own path for its models, ours for the rest."""
    if transformers:
        runtime.start()
        with hf.zero3_construction(zero_init_config(runtime.strategy, runtime.layout_for_init())):
            return make()
    with runtime.init_context(), _lost_initialisations() as lost:
        model = make()
    if lost:
        raise ConfigError(
            f"{type(model).__name__} initialises its weights after building its sub-modules ({lost[0]} on "
            "parameters that ZeRO-3 had already partitioned), so built partitioned it would "
            "silently not get them: build it whole (strategy.sharding.init=whole) or initialise through "
            "self.apply(fn)"
        )
    return model


def _built(
    make: Callable[[], nn.Module], runtime: Runtime, meta: Callable[[], nn.Module], transformers: bool
) -> nn.Module:
    """The model, whole or partitioned as `strategy.sharding.init` says (see the module doc)."""
    strategy = runtime.strategy
    if not strategy.partitions_parameters:
        return make()
    mode, main = strategy.sharding.init, runtime.mesh.rank == 0
    if mode != "auto":
        whole = mode == "whole"
        _announce(main, whole, mode, "asked for")
        return make() if whole else _partitioned(make, runtime, transformers)
    try:
        parameters = count_parameters(meta)
    except Exception as exc:  # noqa: BLE001 - e.g. .item() in __init__; a real error recurs below
        model = make()  # what auto does with a model that fits: built whole
        parameters = sum(p.numel() for p in model.parameters())
        why = f"its size could not be counted on the meta device: {_first_line(exc)}"
        _announce(main, True, mode, why, parameters)
        return model
    whole = fits_whole(parameters, runtime.process)
    why = "fits in one rank's memory" if whole else "too large for one rank"
    _announce(main, whole, mode, why, parameters)
    return make() if whole else _partitioned(make, runtime, transformers)


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
