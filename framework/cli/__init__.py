"""The command line: the only package that imports Hydra and OmegaConf.

Rule: imports any package of the framework; nothing imports it (but `train.py` and the Hydra
launcher plugin). It keeps what only Hydra has: composition, sweeps and the sweeper's value,
starting local processes, the output dir. Runs are built by `framework.build`
(`framework.recipe`) from the plain tree the composed config resolves to; workers get that tree,
never Hydra's global state.

* `main`       `train.py`'s entry: launching, the one-line error a user sees;
* `startup`    argv rewritten and checked before Hydra parses it;
* `argv`       the command line as Hydra will see it (group choices, key typos);
* `config`     the recipe's schema registered in Hydra's ConfigStore, and override checks;
* `build`      a composed config -> `framework.build(...).fit()` -> the monitored value;
* `autotune`   `+autotune=search`: layouts tried in fresh worker groups before the run;
* `help`       what `--help` shows;
* `sweep`      the summary of a multirun.
"""

from framework.cli.main import run
from framework.cli.startup import prepare_argv

__all__ = ["prepare_argv", "run"]
