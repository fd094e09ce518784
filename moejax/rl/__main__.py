"""Agentic RL post-training.

python -m moejax.rl --config experiments/rl_tiny.py --workdir runs/rl_tiny [--init PRETRAINED_WORKDIR]
                    [--config.rl.grpo.iterations=10 ...]

SFT on generated tool-use demonstrations, then GRPO iterations (moejax.rl.loop). With --init, the
model, tokenizer and weights of a `python -m moejax.train` workdir are the starting point. Restarted
with the same workdir, the run resumes from its newest checkpoint.
"""

import logging

from absl import app, flags
from ml_collections import config_flags

from moejax.rl.loop import run
from moejax.train import configure_console


def main(argv, config_flag, workdir_flag, init_flag, verbose_flag):
  del argv
  configure_console(verbose_flag.value)
  if config_flag.value is None or workdir_flag.value is None:
    raise app.UsageError("give --config (an experiment file with an rl section) and --workdir")
  row = run(config_flag.value, workdir_flag.value, init=init_flag.value)
  shown = {k: round(v, 4) for k, v in row.items()
           if isinstance(v, float) and ("pass_rate" in k or k.startswith("reward"))}
  logging.getLogger("moejax.rl").info("done: %s", shown)


if __name__ == "__main__":
  config = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=False)
  workdir = flags.DEFINE_string("workdir", None, "directory for checkpoints and logs")
  init = flags.DEFINE_string("init", None, "workdir of a pretraining run to start from (its model, "
                             "tokenizer and newest weights)")
  verbose = flags.DEFINE_bool("verbose", False, "also show the INFO logs of JAX, orbax and grain")
  app.run(lambda argv: main(argv, config, workdir, init, verbose))
