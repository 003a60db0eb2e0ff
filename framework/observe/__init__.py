"""What a run shows and who listens: the loop's state, its events and callbacks, metrics,
loggers, throughput and MFU, the run's console log.

Rule: imports packages below it (`errors`, `process`, `integrations`, `plan`, `data`,
`backend`), never the loop or the API; nothing here holds an Engine (a callback sees the
`LoopState` and a `Control`).

* `state`       `LoopState` (the loop's counters, saved with checkpoints) and `RunInfo`;
* `callbacks`   the `Event`s, `Callback`, `Control`, and the built-in callbacks;
* `metrics`     the training and evaluation metric sets, synced across ranks;
* `loggers`     console progress, `metrics.jsonl`, wandb;
* `trackers`    TensorBoard and MLflow;
* `background`  a tracker's calls made from a thread of their own (a dead server never holds training);
* `throughput`  samples/s, tokens/s, MFU, the step's time split into phases;
* `runlog`      rank 0's console copied into the run's log file.
"""
