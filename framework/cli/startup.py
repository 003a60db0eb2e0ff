"""Before Hydra runs: the command line rewritten and checked as Hydra will see it, so a typo is
one line naming the nearest key instead of Hydra's multi-line composition error."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from framework.cli import help
from framework.cli.argv import HydraView, check_group_choice, check_untyped_keys, normalize, untyped_overrides
from framework.cli.config import check_override
from framework.errors import ConfigError
from framework.process.environment import env_rank, launched
from framework.process.launch import join_slurm_tasks


def prepare_argv(argv: list[str] | None = None, conf_dir: Path | None = None) -> None:
    """Rewrite `sys.argv` before Hydra parses it (`conf_dir`: the app's configs, default the
    `conf/` beside the script).

    * `+group=x` -> `group=x` for groups of the primary config's defaults list (both forms work).
    * `--local_rank=N` from the `deepspeed` launcher is dropped (LOCAL_RANK carries it).
    * overrides are checked against what Hydra will see (the user's --config-dir, --config-name,
      hydra.searchpath included), so a typo names the nearest key or lists the options.
    * the working directory is importable (a project's own modules, as `python -m` does).
    * On ranks > 0 of a job started by a launcher (torchrun, deepspeed, srun), Hydra must not
      create a second output dir or log file: rank 0's dir is shared with them after the
      process group forms.
    """
    argv = sys.argv if argv is None else argv
    argv[1:] = [a for a in argv[1:] if not a.startswith(("--local_rank=", "--local-rank="))]
    view = HydraView.from_argv(argv, conf_dir or Path(argv[0]).resolve().parent / "conf")
    help.register(view)  # --help's option lines and config, resolved only when Hydra prints them
    if any(a.startswith("+") and not a.startswith("++") for a in view.overrides):
        groups = view.default_groups()
        argv[1:] = normalize(argv[1:], groups)
        view.overrides = normalize(view.overrides, groups)
    if os.getcwd() not in sys.path:
        sys.path.insert(1, os.getcwd())
    if not view.may_set_run_mode():
        _skip_mode_probe()
    try:
        for extra in view.extra_dirs:
            if not Path(extra.removeprefix("file://")).is_dir():
                raise ConfigError(
                    f"--config-dir {extra.removeprefix('file://')}: no such directory (leave -cd out to use "
                    "the framework's own configs, or make that directory with yours)"
                )
        for item in view.overrides:
            check_override(item)
            check_group_choice(item, view)
            check_path_length(item)
    except ConfigError as exc:
        _exit_config_error(exc)
    if untyped_overrides(view.overrides):
        _name_unknown_keys()
    join_slurm_tasks()  # the tasks of a plain `srun` step learn their ranks here, before Hydra runs
    if launched() and env_rank() > 0:
        argv.extend(["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout"])


PATH_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "trainer.checkpoint.dir")


def check_path_length(item: str) -> None:
    """A dir override the file system cannot hold (a name over 255 bytes, a path over 4096) is
    named before Hydra tries to create it."""
    key, _, value = item.lstrip("+").partition("=")
    if key not in PATH_KEYS or not value:
        return
    longest = max(len(part.encode()) for part in value.split("/"))
    if longest > 255 or len(value.encode()) > 4095:
        raise ConfigError(
            f"{key}: a path of {len(value):,} characters (longest name {longest:,}) is more than the file "
            "system allows (255 per name, 4,095 in all); choose a shorter one"
        )


def _exit_config_error(exc: ConfigError) -> NoReturn:
    """End before the run starts: `Error: ...` in one line (from rank 0), exit 1."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise exc
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"Error: {exc}", file=sys.stderr)
    sys.exit(1)


def _name_unknown_keys() -> None:
    """Hydra composes with every node closed (struct mode), so `model.hiden=3` fails inside its
    own composition, in six lines. When a composition fails, the overrides of untyped groups are
    checked on the config composed without them (on this error path only: a run composes once),
    and a key that is not there ends the run in one line naming the nearest key. Hydra 1.3's
    loader method is wrapped for this process only when it has the expected signature."""
    import inspect

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException

    load = ConfigLoaderImpl.load_configuration
    params = ["self", "config_name", "overrides", "run_mode", "from_shell", "validate_sweep_overrides"]
    if getattr(load, "names_unknown_keys", False) or list(inspect.signature(load).parameters) != params:
        return

    def load_configuration(self: Any, config_name: Any, overrides: list[str], *args: Any, **kw: Any) -> Any:
        try:
            return load(self, config_name, overrides, *args, **kw)
        except ConfigCompositionException as failure:
            untyped = untyped_overrides(overrides)
            if not untyped:
                raise
            try:
                cfg = load(self, config_name, [o for o in overrides if o not in untyped], *args, **kw)
                check_untyped_keys(cfg, untyped)
            except ConfigError as exc:
                _exit_config_error(exc)
            except Exception:  # noqa: BLE001 - the failure is elsewhere: Hydra says what
                pass
            raise failure

    load_configuration.names_unknown_keys = True  # type: ignore[attr-defined]
    ConfigLoaderImpl.load_configuration = load_configuration  # type: ignore[method-assign,assignment]


def _skip_mode_probe() -> None:
    """Hydra composes the whole config once only to read `hydra.mode` before composing it again
    to run (a few tenths of a second of every start). When no config we will read sets it, the
    answer is "none", which is what Hydra then decides from --multirun. Hydra 1.3's own method is
    replaced for this process only when it has the expected signature."""
    import inspect

    from hydra._internal.hydra import Hydra

    if list(inspect.signature(Hydra.get_mode).parameters) == ["self", "config_name", "overrides"]:
        Hydra.get_mode = lambda self, config_name, overrides: None  # type: ignore[method-assign]
