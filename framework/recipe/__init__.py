"""One recipe for both doors: a config tree becomes a run (`build`), the same from Python and
from `python train.py`.

    run = framework.build({"model": {...}, "data": {...}, "optimizer": {...}}, output_dir="out")
    run.fit()

* `schema`   the tree's nodes, typed by the API's own dataclasses (`RunConfig` and its parts);
* `tree`     a dict / OmegaConf config as plain data, checked against the schema;
* `targets`  `_target_` nodes made into objects (Hydra's convention, without Hydra);
* `model`    the model node as arguments of the one model builder (`framework.engine.construct`);
* `options`  nodes as the API's options: `fit`'s, the resume choice, loggers, the monitored value;
* `outputs`  what a run writes beside its metrics (config.yaml, deepspeed_config.json, ...);
* `build`    the straight line from a tree to a `Run`;
* `run`      `Run`: `fit()`, `monitored()`, `close()`.

Rule: imports every package below it (`methods` included), never Hydra, OmegaConf or `cli`; it
holds the construction policy (init_from, a method's reference and precompute, the tokenizer
from the model's directory, the resume choice, loggers on rank 0), so that no option is read by
one door only.
"""

from framework.recipe.build import build, build_engine, seed_everything, tree_of, validate
from framework.recipe.run import Run
from framework.recipe.schema import RunConfig

__all__ = ["Run", "RunConfig", "build", "build_engine", "seed_everything", "tree_of", "validate"]
