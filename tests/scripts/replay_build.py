"""Run under torchrun: replay a command-line run from its own saved config with the Python API.

Usage: replay_build.py RUN_DIR OUT_DIR  ->  framework.build(OmegaConf.load(RUN_DIR/config.yaml),
output_dir=OUT_DIR).fit() on every rank (OUT_DIR/metrics.jsonl holds what it logged).
"""

import sys

from omegaconf import OmegaConf

import framework

run_dir, out = sys.argv[1], sys.argv[2]
with framework.build(OmegaConf.load(f"{run_dir}/config.yaml"), output_dir=out) as run:
    run.fit()
