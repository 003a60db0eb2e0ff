"""What the recipe hands the objects it makes: a logger that asks for the run's config gets the
config as data (the nodes it records, not the model and datasets they make)."""

from __future__ import annotations

import copy

from framework.observe.callbacks import Callback
from framework.recipe.options import callbacks_of


class Recorder(Callback):
    """A logger that records what the run hands it."""

    def __init__(self, run_config=None, output_dir=None, name=None):
        self.run_config, self.output_dir, self.name = run_config, output_dir, name


class Counted:
    """A model target that counts how often it is made."""

    def __init__(self, width):
        type(self).made += 1

    made = 0


def test_a_logger_is_handed_the_run_config_as_data_and_nothing_is_made_for_it(tmp_path):
    tree = {
        "model": {"_target_": f"{__name__}.Counted", "width": 3},
        "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
        "logger": {"recorder": {"_target_": f"{__name__}.Recorder", "name": "mine"}},
        "callbacks": {},
    }
    before = copy.deepcopy(tree)
    context = {"output_dir": str(tmp_path), "run_config": tree, "group": None, "name": "job-3"}
    (recorder,) = [c for c in callbacks_of(tree, tmp_path, context) if isinstance(c, Recorder)]
    assert recorder.run_config == before and recorder.run_config["model"]["width"] == 3
    assert Counted.made == 0  # recording the config builds no model
    assert recorder.output_dir == str(tmp_path) and recorder.name == "mine"  # the node's own value wins
    assert tree == before
