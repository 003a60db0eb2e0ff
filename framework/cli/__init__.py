"""The command line: the only package that imports Hydra and OmegaConf.

Rule: imports any package of the framework; nothing imports it (but `train.py` and the Hydra
launcher plugin). Every object is built here from a composed config (`build`), and workers get
plain dicts, never Hydra's global state.

* `main`       `train.py`'s entry: argv, launching, the one-line error a user sees;
* `argv`       the command line as Hydra will see it (group choices, key typos);
* `config`     the config schema (dataclasses in Hydra's ConfigStore) and its checks;
* `build`      a composed config -> the Engine and its parts (the one place);
* `construct`  the model node as arguments of the one builder (`framework.engine.construct`);
* `report`     the files a run writes beside its metrics, and what `+dry_run=true` prints;
* `sweep`      the summary of a multirun.
"""

from framework.cli.main import prepare_argv, run

__all__ = ["prepare_argv", "run"]
