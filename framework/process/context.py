"""The process context: who this process is in its job and where it computes, as one object.

A `ProcessContext` is made once per job, at launch (`ProcessContext.start`: the CLI makes one per
Hydra job, an Engine without one makes its own), and handed to what needs it: the runtime, the
loops, the checkpoint code. It holds the rank, the world, the local rank, the accelerator, the
device and the collective backend, the process groups (the default one and a slow one for long
waits), the small collectives the framework makes, and the teardown that restores what it changed
(the environment a launcher-less process needs, LOCAL_RANK for one GPU per task). Nothing here is
kept in module globals, and importing the framework changes no environment variable.

It is the one place that knows CUDA from CPU: a run is correct on CUDA (nccl, one GPU per local
rank) and on a laptop CPU (gloo) without a branch anywhere else. DeepSpeed's side of the same
decisions (its accelerator, its communication backend, its cached groups) is kept in step by
`framework.backend.deepspeed_globals`, which registers its teardown with `on_close`.

Before a context exists (the command line deciding who prints an error), only what a launcher
put in the environment is known (`framework.process.environment`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from framework.process import watchdog
from framework.process.allocator import tune_host_allocator
from framework.process.environment import (
    choose_accelerator,
    env_local_world_size,
    env_rank,
    env_world_size,
    free_port,
    launched,
    use_tf32,
)

# Waits on long work of one rank (rank 0 hashing, fsyncing, converting a large checkpoint) go
# through a gloo group without a practical timeout: under nccl the default group's watchdog would
# end the job while the other ranks wait, though nothing is stuck (the watchdog module covers that).
SLOW_WAIT = datetime.timedelta(hours=12)


# ------------------------------------------------------------------ the context


class ProcessContext:
    """This process in its job: rank, world, device, backend, groups, collectives, teardown.

    Make it with `ProcessContext.start(...)` (which joins or creates the process group) and close
    it when the job ends (`close()`, or use it as a context manager); a context that found a group
    already there (made by another context of this process, or by the user) leaves that group alone
    when it closes. The attributes are fixed for its life."""

    def __init__(
        self,
        accelerator: str,
        rank: int = 0,
        world_size: int = 1,
        local_rank: int = 0,
        local_world_size: int = 1,
        timeout_s: float = 300.0,
    ):
        self.accelerator = accelerator  # "cuda" or "cpu"
        self.rank, self.world_size = rank, world_size
        self.local_rank, self.local_world_size = local_rank, local_world_size  # as the launcher said
        self.timeout_s = float(timeout_s)
        self.owns_group = False  # this context created the default process group (and destroys it)
        self._owned_env: list[str] = []  # variables this context set; removed on close
        self._replaced_env: dict[str, str] = {}  # launcher values it overwrote; restored on close
        self._slow_group: Any = None
        self._on_close: list[Callable[[], None]] = []
        self._failed = False  # an exception reached the interpreter while this context was open
        self._previous_hook: Any = None
        self._hook: Any = None
        self._world: Any = None  # the default process group this context runs in
        self.closed = False

    # -------------------------------------------------------------- making one
    @classmethod
    def from_launcher(cls, accelerator: str = "auto") -> ProcessContext:
        """This process as its launcher's environment describes it, without joining a group (for
        what only needs to know who it is: a loader's share of the data, the device)."""
        local = int(os.environ.get("LOCAL_RANK", 0))
        return cls(
            choose_accelerator(accelerator), env_rank(), env_world_size(), local, env_local_world_size()
        )

    @classmethod
    def start(cls, accelerator: str = "auto", timeout_s: float = 300.0, tf32: bool = True) -> ProcessContext:
        """Join (or create) this job's process group and return its context.

        A single process started without a launcher gets the five rendezvous variables DeepSpeed
        reads (else it tries MPI discovery) and an in-memory store (no port another program could
        hold); launched processes join through the launcher's variables (`env://`)."""
        choice = choose_accelerator(accelerator)
        ctx = cls(choice, env_rank(), env_world_size(), int(os.environ.get("LOCAL_RANK", 0)), 1, timeout_s)
        if dist.is_initialized():  # another context's, or the user's: use it, leave it be
            ctx.rank, ctx.world_size = dist.get_rank(), dist.get_world_size()
            ctx.local_world_size = env_local_world_size() if launched() else ctx.world_size
            ctx._world = dist.group.WORLD
            return ctx
        ctx._set_up_environment()
        ctx.local_world_size = env_local_world_size()
        if ctx.cuda:
            ctx._share_device_index()
            torch.cuda.set_device(ctx.device)
            use_tf32(tf32)
        tune_host_allocator(ctx.cuda)
        ctx._create_group()
        ctx.rank, ctx.world_size = dist.get_rank(), dist.get_world_size()
        ctx.owns_group, ctx._world = True, dist.group.WORLD
        if ctx.world_size > 1:
            ctx._slow()  # every rank makes it now, together (creating a group is collective)
            # Which process each rank is, so a watchdog can name (and end) a stopped peer on its host.
            watchdog.set_peers(ctx.all_gather_object((socket.gethostname(), os.getpid())))
        ctx._tear_down_at_exit()
        return ctx

    def _set_env(self, key: str, value: str) -> None:
        if key not in os.environ:
            os.environ[key] = value
            self._owned_env.append(key)

    def _set_up_environment(self) -> None:
        if not launched():
            for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
                self._set_env(key, value)
            self._set_env("MASTER_ADDR", "127.0.0.1")
            self._set_env("MASTER_PORT", str(free_port()))
        if self.cuda:
            self._set_env("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a failed collective ends the job
        else:
            # DeepSpeed's CPU accelerator counts its devices from LOCAL_SIZE (its launcher sets it) and
            # otherwise runs `numactl` in a subprocess, which ZeRO-3 does for every gradient bucket.
            self._set_env("LOCAL_SIZE", str(env_local_world_size()))

    def _create_group(self) -> None:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if env_world_size() == 1:
            dist.init_process_group(
                self.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
            return
        kwargs: dict[str, Any] = {"init_method": "env://", "timeout": timeout}
        if self.cuda:  # bound to its device: nccl builds later groups by splitting this one
            kwargs["device_id"] = self.device
        dist.init_process_group(self.backend, **kwargs)

    def _share_device_index(self) -> None:
        """DeepSpeed also reads LOCAL_RANK as a device index (zero.Init, pipeline and ZeRO helpers):
        a process that sees fewer GPUs than its local rank (one GPU per Slurm task) would make it
        name a device that does not exist ("invalid device ordinal"). DeepSpeed is told the index
        chosen here; the launcher's value comes back on close."""
        if self.cuda and self.local_rank != self.device_index:
            self._replaced_env.setdefault("LOCAL_RANK", os.environ.get("LOCAL_RANK", str(self.local_rank)))
            os.environ["LOCAL_RANK"] = str(self.device_index)

    # -------------------------------------------------------------- facts
    @property
    def alive(self) -> bool:
        """True while this context is open and its process group is the process's default one."""
        return not self.closed and self._in_its_group()

    @property
    def cuda(self) -> bool:
        """True when this process trains on CUDA devices."""
        return self.accelerator == "cuda"

    @property
    def backend(self) -> str:
        """The collective backend: nccl on CUDA, gloo otherwise."""
        return "nccl" if self.cuda else "gloo"

    @property
    def device(self) -> torch.device:
        """The device this rank computes on: GPU LOCAL_RANK modulo the GPUs this process sees (one
        GPU per Slurm task sees only its own), the same index DeepSpeed is given (`device_index`)."""
        if self.cuda:
            return torch.device("cuda", self.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    @property
    def device_index(self) -> int:
        """This rank's device index, as handed to DeepSpeed (`args.device_rank`)."""
        return self.device.index or 0

    @property
    def collective_device(self) -> torch.device:
        """Where small tensors for collectives live: this rank's GPU under nccl, the CPU under gloo."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the only rank that writes logs, metrics and summaries."""
        return self.rank == 0

    def describe(self) -> str:
        """One line: "rank 0 of 2 on cpu (gloo)"."""
        return f"rank {self.rank} of {self.world_size} on {self.device} ({self.backend})"

    # -------------------------------------------------------------- collectives
    def _grouped(self) -> bool:
        return self.world_size > 1 and dist.is_initialized()

    def _slow(self) -> Any:
        if self._slow_group is None:
            self._slow_group = dist.new_group(backend="gloo", timeout=SLOW_WAIT)
        return self._slow_group

    def barrier(self, slow: bool = False) -> None:
        """Wait until every rank is here (nothing alone). `slow`: a wait on one rank's long work
        (see SLOW_WAIT)."""
        if self._grouped():
            dist.barrier(group=self._slow() if slow else None)

    def broadcast_object(self, obj: Any, src: int = 0, slow: bool = False) -> Any:
        """Rank `src`'s `obj` on every rank (itself alone); `slow` as for `barrier`."""
        if not self._grouped():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self._slow() if slow else None)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        if not self._grouped():
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_reduce_mean(self, value: float) -> float:
        """Mean of a Python float over ranks."""
        if not self._grouped():
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.collective_device)
        dist.all_reduce(t)
        return float(t.item()) / self.world_size

    def all_reduce_min(self, value: int) -> int:
        """The smallest of every rank's integer."""
        if not self._grouped():
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.collective_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on at least one."""
        if not self._grouped():
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.collective_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def all_ranks(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on every rank; through the gloo group on the
        CPU, so it never waits for a device (a stream's ranks agree on where a pass ends)."""
        if not self._grouped():
            return flag
        t = torch.tensor([0 if flag else 1], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._slow())
        return int(t.item()) == 0

    def agree(self, stop: bool, end: bool) -> tuple[bool, bool]:
        """(any rank's `stop`, any rank's `end`) on every rank, in one collective through the
        gloo group as for `all_ranks` (a stream's ranks decide together how a pass ends)."""
        if not self._grouped():
            return stop, end
        t = torch.tensor([int(stop), int(end)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._slow())
        return bool(t[0]), bool(t[1])

    # -------------------------------------------------------------- teardown
    def _in_its_group(self) -> bool:
        return dist.is_initialized() and dist.group.WORLD is self._world

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call `fn` when this context closes, after its group is destroyed (once per `fn`)."""
        if fn not in self._on_close:
            self._on_close.append(fn)

    def _tear_down_at_exit(self) -> None:
        """A script that ends without closing still exits cleanly (a 2-rank gloo exit without
        destroying the group can SIGABRT): the context closes at interpreter exit, waiting for the
        other ranks only if no exception ended this one."""
        self._previous_hook = sys.excepthook

        def note_failure(*args: Any) -> None:
            self._failed = True
            self._previous_hook(*args)

        self._hook = note_failure
        sys.excepthook = note_failure
        atexit.register(self._close_at_exit)

    def _close_at_exit(self) -> None:
        self.close(sync=not self._failed)

    def close(self, sync: bool = True, timeout_s: float = 30.0) -> None:
        """Destroy the group this context created (a 2-rank gloo exit without it can SIGABRT) and
        restore the environment it changed; a joined context only forgets its own groups.

        `sync` (gloo): first wait, at most `timeout_s`, until every rank is here, so that no rank
        exits and drops connections another rank's gloo threads still use (that too can SIGABRT the
        slower rank). After a failure pass sync=False: the other ranks may sit in a collective, and
        waiting for them would only delay the exit."""
        if self.closed:
            return
        self.closed = True
        self._slow_group = None
        if self.owns_group and self._in_its_group():
            if sync and dist.get_backend() == "gloo" and dist.get_world_size() > 1:
                with contextlib.suppress(RuntimeError):  # a rank that never came: tear down anyway
                    dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
            dist.destroy_process_group()
            for fn in self._on_close:
                fn()
        while self._owned_env:
            os.environ.pop(self._owned_env.pop(), None)
        os.environ.update(self._replaced_env)
        self._replaced_env.clear()
        if self._previous_hook is not None:
            atexit.unregister(self._close_at_exit)
            if sys.excepthook is self._hook:
                sys.excepthook = self._previous_hook

    def __enter__(self) -> ProcessContext:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(sync=kind is None)
