"""Training entry point.

python -m moejax.train --config experiments/tiny.py --workdir runs/tiny [--config.optim.lr=1e-3 ...]

Runs the progressive-context stages of `config.train.stages` in order inside one process, checkpoints
the whole train state and the data iterator, and resumes from the newest readable checkpoint in
`--workdir` when restarted.
"""

import json
import logging
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from moejax import checkpoint as ckpt_lib
from moejax.config import ConfigError, validate
from moejax.data import load_manifest, make_iterator
from moejax.data.prepare import prepare
from moejax.model import build_model
from moejax.monitor import Monitor, to_row
from moejax.train_step import init_state, make_eval_step, make_train_step

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "directory for checkpoints and logs")

log = logging.getLogger("moejax.train")


def stage_at(stages, step: int):
  """(stage index, first step of that stage) for a global step; past the end -> the last stage."""
  start = 0
  for i, (_, steps, _) in enumerate(stages):
    if step < start + steps:
      return i, start
    start += steps
  return len(stages) - 1, start - stages[-1][1]


def _batch_iterator(config, stage, split, seed):
  seq_len, _, tokens = stage
  return make_iterator(config.data, split, seq_len, tokens // seq_len, seed)


def evaluate(eval_step, state, config, stage) -> dict:
  it = iter(_batch_iterator(config, stage, "validation", config.train.seed))
  total, count = 0.0, 0.0
  for _ in range(config.train.eval_batches):
    m = eval_step(state, next(it))
    total += float(m["nll"]) * float(m["tokens"])
    count += float(m["tokens"])
  return {"val_loss": total / max(count, 1.0)}


def run(config, workdir: str) -> dict:
  """Trains to the end of the last stage; returns the final metrics row."""
  validate(config)
  os.makedirs(workdir, exist_ok=True)
  manifest = load_manifest(prepare(config.data))
  tokenizer_vocab = manifest["tokenizer"]["vocab_size"]
  if config.model.vocab_size < tokenizer_vocab:
    raise ConfigError(f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's "
                      f"{tokenizer_vocab} ids")
  model = build_model(config)
  stages = [tuple(s) for s in config.train.stages]
  total_steps = sum(s[1] for s in stages)

  state, optimizer, _ = init_state(model, config, jax.random.key(config.train.seed), total_steps)
  manager = ckpt_lib.Manager(os.path.join(workdir, "checkpoints"), config.train.keep_checkpoints)
  data_it = _iterator_for_step(config, stages, 0)
  restored = manager.restore_latest(state, lambda s: _iterator_for_step(config, stages, s))
  if restored is not None:
    state, data_it = restored
    log.info("resumed from step %d", int(state.step))

  train_step = jax.jit(make_train_step(model, optimizer, config), donate_argnums=0)
  eval_step = jax.jit(make_eval_step(model, config))
  monitor = Monitor(workdir, config, total_steps, start_step=int(state.step))
  row = {}
  step = int(state.step)
  stage_idx, _ = stage_at(stages, step)
  try:
    while step < total_steps:
      new_stage, _ = stage_at(stages, step)
      if new_stage != stage_idx:
        # A new context length: same state, new data stream; the step retraces for the new shape.
        stage_idx = new_stage
        data_it = _iterator_for_step(config, stages, step)
        log.info("stage %d: seq_len=%d", stage_idx, stages[stage_idx][0])
      batch = next(data_it)
      t0 = time.perf_counter()
      state, m = train_step(state, batch)
      step += 1
      row = to_row(jax.device_get(m))
      row.update(step=step, stage=stage_idx, seq_len=stages[stage_idx][0],
                 tokens_per_s=float(np.sum(batch["loss_mask"] >= 0)) / (time.perf_counter() - t0))
      if config.train.eval_every and step % config.train.eval_every == 0:
        row.update(evaluate(eval_step, state, config, stages[stage_idx]))
      monitor.record(step, row)
      if int(state.bad_steps) >= config.train.max_bad_steps:
        raise FloatingPointError(
            f"{int(state.bad_steps)} consecutive non-finite steps at step {step}: stopping. The last good "
            f"checkpoint is step {manager.latest_step()} in {workdir}")
      if step % config.train.checkpoint_every == 0 or step == total_steps:
        manager.save(step, state, data_it)
  finally:
    manager.wait()
    monitor.close()
  return row


def _iterator_for_step(config, stages, step):
  """The train data stream of the stage that `step` falls in; each stage has its own seed."""
  idx, _ = stage_at(stages, step)
  return iter(_batch_iterator(config, stages[idx], "train", config.train.seed + idx))


def main(argv):
  del argv
  if _CONFIG.value is None or _WORKDIR.value is None:
    sys.exit("usage: python -m moejax.train --config experiments/tiny.py --workdir DIR")
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  row = run(_CONFIG.value, _WORKDIR.value)
  print(json.dumps({k: v for k, v in row.items() if isinstance(v, int | float)}))


if __name__ == "__main__":
  app.run(main)
