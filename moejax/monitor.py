"""Run monitoring: progress bar, TensorBoard scalars, a JSONL metrics log and alerts.

The expert-collapse alert fires when MaxVio_batch stays above `train.maxvio_alert` for
`train.maxvio_alert_steps` consecutive steps: a router that keeps overloading a few experts is the
usual first sign of collapse, long before the loss shows it.
"""

import json
import logging
import os

import numpy as np
from tensorboardX import SummaryWriter
from tqdm import tqdm

log = logging.getLogger("moejax.monitor")


def to_row(metrics) -> dict:
  """Flattens a dict of scalars and small arrays into {name: float}; vectors become name/i entries."""
  row = {}
  for name, value in metrics.items():
    a = np.asarray(value)
    if a.size == 1:
      row[name] = float(a.reshape(()))
    else:
      for i, v in enumerate(a.reshape(-1)):
        row[f"{name}/{i}"] = float(v)
  return row


class Monitor:
  def __init__(self, workdir: str, config, total_steps: int, start_step: int = 0):
    self.config = config
    self.writer = SummaryWriter(os.path.join(workdir, "tb"))
    self.jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")  # noqa: SIM115 - closed in close()
    self.bar = tqdm(total=total_steps, initial=start_step, disable=not config.train.progress_bar,
                    dynamic_ncols=True, file=None)
    self.high_maxvio_steps = 0
    self.alerts = 0

  def record(self, step: int, row: dict) -> None:
    self.jsonl.write(json.dumps(row) + "\n")
    every = self.config.train.log_every
    if step % every == 0 or "val_loss" in row:
      for k, v in row.items():
        if isinstance(v, float) and np.isfinite(v):
          self.writer.add_scalar(k, v, step)
      self.jsonl.flush()
    self.bar.update(1)
    self.bar.set_postfix(loss=f"{row.get('loss', float('nan')):.3f}",
                         maxvio=f"{row.get('moe/maxvio_batch', float('nan')):.2f}")
    if not row.get("finite", 1.0):
      log.warning("step %d: non-finite loss or gradient; update skipped (%d in a row)", step,
                  int(row.get("bad_steps", 0)))
    self._check_maxvio(step, row)

  def _check_maxvio(self, step: int, row: dict) -> None:
    maxvio = row.get("moe/maxvio_batch")
    if maxvio is None:
      return
    self.high_maxvio_steps = self.high_maxvio_steps + 1 if maxvio > self.config.train.maxvio_alert else 0
    if self.high_maxvio_steps == self.config.train.maxvio_alert_steps:
      self.alerts += 1
      log.warning("expert-collapse alert at step %d: MaxVio_batch has stayed above %.2f for %d steps "
                  "(now %.2f)", step, self.config.train.maxvio_alert, self.high_maxvio_steps, maxvio)

  def close(self) -> None:
    self.bar.close()
    self.writer.close()
    self.jsonl.close()
