"""Agentic RL on a 2-core CPU: the tiny hybrid MoE of experiments/tiny.py learns the calculator tool by
SFT, then GRPO.

python -m moejax.rl --config experiments/rl_tiny.py --workdir runs/rl_tiny

Arithmetic tasks (products of 2- and 3-digit numbers, sums of three) need the calculator. Half of the
SFT demonstrations answer directly, so the SFT model often answers without the tool, and wrongly;
GRPO raises the pass rate by teaching it that the tool call pays, and to copy the numbers right
(BENCHMARKS.md, "Agentic RL (experiments/rl_tiny.py)").
"""

import pathlib

from moejax.config import load_experiment
from moejax.rl.config import rl_config


def get_config():
  c = load_experiment(pathlib.Path(__file__).with_name("tiny.py"))
  c.train.stages = ((512, 1, 512),)  # not trained by RL: only the model's default cache length
  c.train.log_every = 1
  c.train.progress_bar = False
  # Two MLA layers of four (KMKM): the copying of numbers into tool calls and answers came sooner in SFT.
  c.model.layer_pattern = "KMKM"
  r = c.rl = rl_config()
  r.sft.examples, r.sft.steps = 800, 400
  # At lr 1e-3 the held-out pass rate peaked after 12 iterations and fell back; 5e-4 kept rising.
  r.grpo.iterations, r.grpo.refill_rounds, r.grpo.lr = 40, 1, 5e-4
  r.eval.tasks, r.eval.every = 64, 8
  r.checkpoint_every = 8
  return c
