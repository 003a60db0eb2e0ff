"""The command line as Hydra will see it, and the checks made on it before Hydra composes.

`HydraView` reads Hydra's own flags (`--config-path/-cp`, `--config-name/-cn`, `--config-dir/-cd`)
and `hydra.searchpath=[...]`, and answers from Hydra's config loader over exactly that search
path: which options a group has, which groups the primary config's defaults list holds. So a
user's own config dir, primary config and ConfigStore entries are first class: a pre-check never
refuses what Hydra would accept. Keys of the untyped groups (model, optimizer, ...) are checked
only where Hydra's own composition of them fails (`check_untyped_keys`): a run composes once.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.cli.config import GROUPS, schema_field
from framework.errors import ConfigError

# Hydra's flags that take a value (`--flag value` or `--flag=value`).
_VALUE_FLAGS = {
    "--config-path": "config_path",
    "-cp": "config_path",
    "--config-name": "config_name",
    "-cn": "config_name",
    "--config-dir": "config_dir",
    "-cd": "config_dir",
    "--package": None,
    "-p": None,
    "--cfg": None,
    "-c": None,
    "--experimental-rerun": None,
}
_TYPED = ("trainer", "data", "strategy")  # groups whose keys the schema types


@dataclass
class HydraView:
    """Where Hydra looks for configs, and the overrides it will apply."""

    primary_dir: Path  # the app's config dir (train.py's `conf/`, or --config-path)
    config_name: str = "train"
    extra_dirs: list[str] = field(default_factory=list)  # --config-dir, as file:// entries
    overrides: list[str] = field(default_factory=list)
    searchpath_override: str | None = None  # a hydra.searchpath=[...] override, as given

    @classmethod
    def from_argv(cls, argv: list[str], default_dir: Path, default_name: str = "train") -> HydraView:
        """Parse `argv[1:]` (flags and overrides) for an app whose configs are in `default_dir`."""
        values: dict[str, str] = {}
        overrides: list[str] = []
        args = iter(argv[1:])
        for arg in args:
            flag, eq, value = arg.partition("=")
            if arg.startswith("-") and flag in _VALUE_FLAGS:
                value = value if eq else next(args, "")
                if _VALUE_FLAGS[flag]:
                    values[str(_VALUE_FLAGS[flag])] = value
            elif not arg.startswith("-"):
                overrides.append(arg)
        primary = Path(values.get("config_path") or default_dir)
        if not primary.is_absolute():
            primary = (default_dir.parent / primary).resolve()
        view = cls(primary, values.get("config_name", default_name), overrides=overrides)
        if values.get("config_dir"):
            view.extra_dirs.append(f"file://{os.path.abspath(values['config_dir'])}")  # as Hydra does
        view.searchpath_override = next((o for o in overrides if o.split("=")[0] == "hydra.searchpath"), None)
        return view

    @property
    def customised(self) -> bool:
        """False for the framework's own configs as shipped (the fast path: no loader needed)."""
        return bool(self.extra_dirs or self.searchpath_override or self.config_name != "train")

    def may_set_run_mode(self) -> bool:
        """Whether a config Hydra will read could set `hydra.mode` (so Hydra must compose once
        just to read it): an override of it, an option file that sets it, or configs we do not know."""
        if self.customised or any(o.lstrip("+~").startswith("hydra.mode") for o in self.overrides):
            return True
        chosen = {o.lstrip("+").split("=", 1)[0]: o.split("=", 1)[1] for o in self.overrides if "=" in o}
        for file in [self.primary_dir / "train.yaml", *self.primary_dir.glob("*/*.yaml")]:
            group, option = file.parent.name, file.stem
            selected = file.parent == self.primary_dir or option in chosen.get(group, "").strip("[]").split(
                ","
            )
            if selected and any(line.strip().startswith("mode:") for line in file.read_text().splitlines()):
                return True
        return False

    def _search_overrides(self) -> list[str]:
        """The user's hydra.searchpath override: the loader applies it itself, as in a run."""
        return [self.searchpath_override] if self.searchpath_override else []

    @contextlib.contextmanager
    def _loader(self) -> Iterator[Any]:
        """Hydra's config loader over the search path Hydra's `_run_hydra` builds: the app's dir,
        then each --config-dir as a "command-line" entry just before the ConfigStore's. (Given as a
        hydra.searchpath override instead, a --config-dir could not hold the primary config: the
        loader reads that override from the primary config it is looking for.)"""
        from hydra import version
        from hydra._internal.hydra import Hydra
        from hydra._internal.utils import create_config_search_path
        from hydra.core.config_search_path import SearchPathQuery
        from hydra.core.global_hydra import GlobalHydra

        version.setbase("1.3")
        search_path = create_config_search_path(str(self.primary_dir))
        for entry in self.extra_dirs:
            search_path.prepend("command-line", entry, anchor=SearchPathQuery(provider="schema"))
        GlobalHydra.instance().clear()
        try:
            Hydra.create_main_hydra2(task_name="app", config_search_path=search_path)
            yield GlobalHydra.instance().config_loader()
        finally:
            GlobalHydra.instance().clear()

    def group_options(self, group: str) -> list[str] | None:
        """The options of `group` Hydra would find, or None when it is not a group there."""
        if not self.customised:  # the app's files and the ConfigStore's entries, as Hydra lists them
            from hydra.core.config_store import ConfigStore

            found = {p.stem for p in (self.primary_dir / group).glob("*.yaml")}
            with contextlib.suppress(OSError):  # not a group of the store
                found |= {n[:-5] for n in ConfigStore.instance().list(group) if n.endswith(".yaml")}
            return sorted(found) or None
        try:
            with self._loader() as loader:
                options = loader.get_group_options(
                    group, config_name=self.config_name, overrides=self._search_overrides()
                )
        except Exception:  # noqa: BLE001 - Hydra will report it, with its own message
            return None
        return sorted(options) if options else None

    def default_groups(self) -> set[str]:
        """The groups the primary config's defaults list selects an option of."""
        if not self.customised:
            return set(GROUPS)
        from hydra.types import RunMode

        try:
            with self._loader() as loader:
                defaults = loader.compute_defaults_list(
                    self.config_name, self._search_overrides(), RunMode.RUN
                )
        except Exception:  # noqa: BLE001
            return set()
        return {d.override_key.split("@")[0] for d in defaults.defaults if getattr(d, "override_key", None)}


def normalize(overrides: list[str], default_groups: set[str]) -> list[str]:
    """`+group=x` and `group=x` both select an option of a group in the defaults list: Hydra
    accepts only one form per entry, so the `+` of those groups (and of `+dry_run`) is dropped."""
    out = []
    for item in overrides:
        if item.startswith("+") and not item.startswith("++"):
            key = item[1:].split("=", 1)[0]
            if key in default_groups or key == "dry_run":
                item = item[1:]
        out.append(item)
    return out


def check_group_choice(item: str, view: HydraView) -> None:
    """Reject `group=option` when the group has no such option, listing the options (sweeps
    `a,b` and lists `[a,b]` are checked element by element)."""
    key, sep, value = item.lstrip("+").partition("=")
    if not sep or "." in key or value in ("null", "") or key.startswith("hydra"):
        return
    options = view.group_options(key)
    if options is None:
        return
    for choice in value.strip("[]").split(","):
        choice = choice.strip()
        if choice and choice not in options and not any(ch in choice for ch in "()*$"):
            raise ConfigError(f"unknown {key} '{choice}'; options: {', '.join(options)}")


def untyped_overrides(overrides: list[str]) -> list[str]:
    """The `group.key=value` overrides of untyped groups (model, optimizer, data.dataset, ...):
    no schema knows their keys, so Hydra's composition is where a wrong one fails."""
    found = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        parts = key.split(".")
        if item.startswith(("+", "~")) or not sep or len(parts) < 2 or key.startswith("hydra") or "/" in key:
            continue
        if parts[0] in _TYPED and _typed(parts):
            continue  # check_override's job
        found.append(item)
    return found


def _typed(parts: list[str]) -> bool:
    try:
        return schema_field(parts) is not None
    except ConfigError:  # a typo in the typed part
        return True


def check_untyped_keys(cfg: Any, overrides: list[str]) -> None:
    """Reject an override of `untyped_overrides` whose key the composed `cfg` does not have,
    naming the nearest key (a ConfigError)."""
    for item in untyped_overrides(overrides):
        _check_key_path(cfg, item.partition("=")[0].split("."))


def _check_key_path(cfg: Any, parts: list[str]) -> None:
    """A ConfigError naming the nearest key when `parts` leaves the keys `cfg` has."""
    from omegaconf import DictConfig

    node: Any = cfg
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return
        known = [str(k) for k in node.keys()]  # (`in` is False for a ??? value)
        if part not in known:
            where = ".".join(parts[:depth])
            close = difflib.get_close_matches(part, known, n=1)
            hint = f"did you mean '{where}.{close[0]}'? " if close else ""
            raise ConfigError(
                f"unknown config key '{'.'.join(parts)}'; {hint}valid keys here: {', '.join(known)} "
                f"(to add a new key write ++{'.'.join(parts)}=...)"
            )
        if depth == len(parts) - 1:
            return
        try:
            node = node[part]
        except Exception:  # noqa: BLE001 - a ??? or an interpolation: nothing more to check
            return
