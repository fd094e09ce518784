"""Agentic RL on a 2-core CPU: the tiny hybrid MoE of experiments/tiny.py learns the calculator tool by
SFT, then GRPO.

python -m moejax.rl --config experiments/rl_tiny.py --workdir runs/rl_tiny

Arithmetic tasks (products of 3- and 4-digit numbers, sums of three) need the calculator. Half of the
SFT demonstrations answer directly, so the SFT model often answers without the tool, and wrongly;
GRPO raises the pass rate by teaching it that the tool call pays (BENCHMARKS.md, "Agentic RL").
"""

import pathlib

from moejax.config import load_experiment
from moejax.rl.config import rl_config


def get_config():
  c = load_experiment(pathlib.Path(__file__).with_name("tiny.py"))
  c.train.stages = ((512, 1, 512),)  # not trained by RL: only the model's default cache length
  c.train.log_every = 1
  c.train.progress_bar = False
  c.rl = rl_config()
  return c
