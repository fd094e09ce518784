"""Training entry point.

python -m moejax.train --config experiments/tiny.py --workdir runs/tiny [--config.optim.lr=1e-3 ...]

Runs the progressive-context stages of `config.train.stages` (moejax.training.loop.run), and resumes
from the newest readable checkpoint in `--workdir` when restarted.
"""

import json
import logging
import sys

from absl import app, flags
from ml_collections import config_flags

from moejax.training.loop import run


def _define_flags():
  """Flags are defined only when run as a program: importing this module (tests, notebooks, other
  entry points such as moejax.params) must not claim the global absl flag names."""
  config = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=False)
  workdir = flags.DEFINE_string("workdir", None, "directory for checkpoints and logs")
  return config, workdir


def main(argv, config_flag, workdir_flag):
  del argv
  if config_flag.value is None or workdir_flag.value is None:
    sys.exit("usage: python -m moejax.train --config experiments/tiny.py --workdir DIR "
             "[--config.optim.lr=1e-3 --config.train.stages='((128, 30, 2048),)' ...]\n"
             "--config (an experiment file) and --workdir (checkpoints and logs) are required")
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  row = run(config_flag.value, workdir_flag.value)
  print(json.dumps({k: v for k, v in row.items() if isinstance(v, int | float)}))


if __name__ == "__main__":
  _flags = _define_flags()
  app.run(lambda argv: main(argv, *_flags))
