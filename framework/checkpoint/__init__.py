"""Checkpoints that resume exactly and are never half-written, and preemption.

Rule: imports the packages below it (`errors`, `process`, `integrations`, `plan`, `data`,
`backend`, `observe`), never the loop, the API or the CLI; DeepSpeed's own files are read and
converted through `framework.backend` (`runtime`, `checkpoint_files`).

* `store`       the layout on disk, atomic writes, COMPLETE.json, `latest`, prune, resolve,
                conversion for another world size;
* `lock`        one run at a time per checkpoints dir;
* `compatibility` whether a checkpoint fits the run that loads it (setup, an adapter's base,
                the layout);
* `staging`     exports written whole or not at all;
* `manager`     saves and loads the stateful parts it is handed (runtime, loop state, metrics,
                RNG), and the callback that saves on schedule;
* `preemption`  the preemption signals (TERM, USR1, USR2) and the ranks' agreement on them.
"""

from framework.checkpoint.compatibility import needs_universal
from framework.checkpoint.manager import CheckpointManager, Stateful, load, newest, save
from framework.checkpoint.store import check, complete_checkpoints, find_resumable, mark_bad, resolve, tag_for

__all__ = [
    "CheckpointManager",
    "Stateful",
    "check",
    "complete_checkpoints",
    "find_resumable",
    "load",
    "mark_bad",
    "needs_universal",
    "newest",
    "resolve",
    "save",
    "tag_for",
]
