"""The command line's door into the recipe: a composed config is handed to `framework.build`
as the plain tree it resolves to (workers and Python users build from the same), trained, and
its monitored value returned to the sweeper."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.recipe import build


def tree(cfg: DictConfig) -> dict[str, Any]:
    """The composed config as plain data, interpolations resolved."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def train(
    cfg: DictConfig | dict[str, Any], output_dir: str | None, context: dict[str, Any] | None = None
) -> float | None:
    """Train in this process (one rank of the job): `framework.build(cfg, output_dir).fit()`;
    the monitored value (`trainer.monitor`) for sweepers. `context`: the sweep's `group` and
    this job's `name` for trackers, and `log_file`, where rank 0 copies its console."""
    context = context or {}
    config = tree(cfg) if isinstance(cfg, DictConfig) else cfg
    with build(
        config,
        output_dir,
        group=context.get("group"),
        name=context.get("name"),
        log_file=context.get("log_file"),
    ) as run:
        run.fit()
        return run.monitored()
