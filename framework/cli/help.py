"""`python train.py --help`: each group's options with one line each, from the option's own file,
and the composed config without the keys kept only for old command lines (`RENAMED`).

Hydra's help template (conf/train.yaml) calls two resolvers registered before Hydra runs:
`${hydraspeed_options:}` and `${hydraspeed_config:}`. What they return is escaped for the
`string.Template` Hydra fills the template with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.cli.argv import HydraView
from framework.cli.config import GROUPS
from framework.recipe.schema import RENAMED

WIDTH = 100  # a description longer than this is cut at a word


def describe(path: Path) -> str:
    """The first sentence of an option file's leading comment, cut at `WIDTH` characters (its
    `_target_` when it has no comment)."""
    lines = path.read_text().splitlines()
    words: list[str] = []
    for line in lines:
        text = line.strip()
        if not text.startswith("#") or text.startswith("#  "):  # the comment ends, or an example starts
            break
        text = text.lstrip("#").strip()
        if text.startswith("@package"):
            continue
        words += text.split()
        if text.endswith((".", ":")):
            break
    text = " ".join(words).rstrip(":;,. ")
    if not text:
        return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("_target_:")), "")
    return text if len(text) <= WIDTH else text[: text.rfind(" ", 0, WIDTH)] + " ..."


def options_text(view: HydraView) -> str:
    """Each group, then one line per option: name and description."""
    dirs = [view.primary_dir, *(Path(d.removeprefix("file://")) for d in view.extra_dirs)]
    out = []
    for group in sorted(GROUPS):
        options = view.group_options(group) or []
        if not options:
            continue
        out.append(f"{group}:")
        width = max(len(o) for o in options)
        for option in options:
            found = next(
                (d / group / f"{option}.yaml" for d in dirs if (d / group / f"{option}.yaml").is_file()), None
            )
            line = f"  {option:<{width}}  {describe(found)}" if found else f"  {option}"
            out.append(line.rstrip())
    return "\n".join(out)


def config_text(root: DictConfig) -> str:
    """The composed config, without Hydra's node and without the renamed keys' old names."""
    cfg = OmegaConf.to_container(root, resolve=False)
    assert isinstance(cfg, dict)
    cfg.pop("hydra", None)
    for old in RENAMED:
        *parents, leaf = old.split(".")
        node: Any = cfg
        for key in parents:
            node = node.get(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    return OmegaConf.to_yaml(OmegaConf.create(cfg))


def register(view: HydraView) -> None:
    """The resolvers the help template calls, for the configs `view` sees."""
    OmegaConf.register_new_resolver(
        "hydraspeed_options", lambda: options_text(view).replace("$", "$$"), replace=True
    )
    OmegaConf.register_new_resolver(
        "hydraspeed_config", lambda *, _root_: config_text(_root_).replace("$", "$$"), replace=True
    )
