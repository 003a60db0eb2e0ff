"""Data on its way to the step: loaders, the background prefetcher, device transfer, batches and
outputs of every usual shape, and the datasets that ship with the project.

Rule: imports `framework.errors`, `framework.process`, `framework.integrations` and
`framework.plan` only; never DeepSpeed or Hydra.

* `loaders`    samplers, this rank's loaders, the `Prefetcher`, the `BatchIterator` a step pulls from;
* `transfer`   batches to the device (pinned memory and a side stream on CUDA);
* `outputs`    tensors, tuples, dicts, `ModelOutput`s: how a batch is fed, what a loss reads;
* `labels`     `IGNORE_INDEX` (-100), the label no loss, item count or metric counts;
* `datasets`   shipped and local data (digits, chars, CSV, Hugging Face files): nothing downloads.
"""
