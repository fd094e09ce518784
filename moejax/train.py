"""Training entry point.

python -m moejax.train --config experiments/tiny.py --workdir runs/tiny [--config.optim.lr=1e-3 ...]
python -m moejax.train ... --coordinator HOST:PORT --num_processes N --process_id I   (one per process)

Runs the progressive-context stages of `config.train.stages` (moejax.training.loop.run), and resumes
from the newest readable checkpoint in `--workdir` when restarted. The console shows the progress bar,
a line per evaluation and checkpoint, warnings and a closing summary; `--verbose` adds the INFO logs of
JAX, orbax and grain. Several processes (moejax.parallel.distributed) connect through the flags above, a
Kubernetes JobSet's environment (deploy/k8s) or SLURM; `--workdir` may be an s3:// or gs:// URL.
Unless the environment sets XLA's allocator (XLA_PYTHON_CLIENT_MEM_FRACTION, _PREALLOCATE or _ALLOCATOR),
XLA may take `moejax.device_memory.default_memory_fraction()` of the GPU.
"""

import logging
import sys

import jax
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags
from tqdm import tqdm

from moejax.device_memory import use_default_memory_fraction
from moejax.parallel import distributed
from moejax.training.loop import run

# Their INFO lines (orbax's and grain's come through absl's logger) would bury the progress bar.
THIRD_PARTY_LOGGERS = ("absl", "jax", "jaxlib", "orbax", "grain", "etils", "tensorstore", "fsspec",
                       "tensorboardX", "matplotlib", "PIL", "urllib3", "filelock")


def _define_flags():
  """Flags are defined only when run as a program: importing this module (tests, notebooks, other
  entry points such as moejax.params) must not claim the global absl flag names."""
  config = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=False)
  workdir = flags.DEFINE_string("workdir", None, "directory for checkpoints and logs (relative to the "
                                "current directory, or a URL)")
  verbose = flags.DEFINE_bool("verbose", False, "also show the INFO logs of JAX, orbax and grain")
  cluster = (
      flags.DEFINE_string("coordinator", None, "HOST:PORT of process 0, for a run of several processes"),
      flags.DEFINE_integer("num_processes", None, "processes of the run"),
      flags.DEFINE_integer("process_id", None, "this process's index, from 0"),
      flags.DEFINE_integer("distributed_timeout", distributed.DEFAULT_TIMEOUT_S,
                           "seconds to wait for the other processes (connecting, barriers, a silent peer) "
                           "before stopping with an error"))
  return config, workdir, verbose, cluster


class _ConsoleHandler(logging.Handler):
  """Writes through tqdm, which lifts the progress bar out of the way and redraws it below the line."""

  def emit(self, record):
    try:
      tqdm.write(self.format(record), file=sys.stderr)
    except Exception:  # noqa: BLE001 - logging must never stop the run
      self.handleError(record)


class _ConsoleFormatter(logging.Formatter):
  def __init__(self, verbose: bool, process: str = ""):
    super().__init__(f"%(asctime)s {process}%(levelname).1s %(name)s: %(message)s" if verbose
                     else f"%(asctime)s {process}%(message)s", datefmt="%H:%M:%S")
    self.verbose = verbose

  def format(self, record):
    text = super().format(record)
    if not self.verbose and record.levelno >= logging.WARNING:
      stamp, _, rest = text.partition(" ")
      text = f"{stamp} {record.levelname}: {rest}"
    return text


def configure_console(verbose: bool, process: str = "") -> None:
  """Our INFO lines and everyone's warnings on stderr in one short format; the third-party INFO
  logs only when `verbose`. `process` prefixes each line (the process of a multi-process run)."""
  root = logging.getLogger()
  for handler in list(root.handlers):
    root.removeHandler(handler)  # absl's, which app.run installs, prefixes every line with file:line
  handler = _ConsoleHandler()
  handler.setFormatter(_ConsoleFormatter(verbose, process))
  root.addHandler(handler)
  root.setLevel(logging.INFO)
  level = logging.NOTSET if verbose else logging.WARNING
  for name in THIRD_PARTY_LOGGERS:
    logging.getLogger(name).setLevel(level)
  absl_logging.set_verbosity(absl_logging.INFO if verbose else absl_logging.WARNING)
  logging.captureWarnings(True)  # Python warnings through the same handler, not across the bar


def main(argv, config_flag, workdir_flag, verbose_flag, cluster_flags):
  del argv
  if config_flag.value is None or workdir_flag.value is None:
    sys.exit("usage: python -m moejax.train --config experiments/tiny.py --workdir DIR "
             "[--config.optim.lr=1e-3 --config.train.stages='((128, 30, 2048),)' --verbose ...]\n"
             "--config (an experiment file) and --workdir (checkpoints and logs) are required")
  configure_console(verbose_flag.value)
  coordinator, num_processes, process_id, timeout = (f.value for f in cluster_flags)
  if distributed.initialize(coordinator, num_processes, process_id, timeout) is not None:
    configure_console(verbose_flag.value, f"[{jax.process_index()}/{jax.process_count()}] ")
  try:
    run(config_flag.value, workdir_flag.value)  # closes with a summary of the run on the console
  except Exception as e:
    distributed.exit_on_error(e)  # several processes: stop now, not at a shutdown barrier
    raise


if __name__ == "__main__":
  # Before anything can start JAX's backend, which reads it once: flag parsing below already runs
  # the config file.
  use_default_memory_fraction()
  _flags = _define_flags()
  app.run(lambda argv: main(argv, *_flags))
