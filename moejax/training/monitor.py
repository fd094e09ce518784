"""Run monitoring: progress bar, TensorBoard scalars, a JSONL metrics log and alerts.

The expert-collapse alert fires when the worst MoE layer's MaxVio_batch stays above
`train.maxvio_alert` for `train.maxvio_alert_steps` consecutive steps, and again every that many
steps while it stays there: a router that keeps overloading a few experts is the usual first sign
of collapse, long before the loss shows it. The worst layer, not the mean over layers, because one
collapsed layer among many barely moves the mean.

Per-expert loads (`moe/<layer>/load`, one value per expert, 1 = a fair share) are vectors: at
logging steps they go to the JSONL row as lists and to TensorBoard as one histogram per layer,
since hundreds of experts times tens of layers would swamp the scalar dashboard.

A resumed run first drops what the previous process logged past the restored step (JSONL rows
and, through TensorBoard's purge step, its events), so each step appears once.

In a multi-process run only process 0 writes the log, TensorBoard and the progress bar
(`writes=False` elsewhere). With `train.metrics_port`, every process also serves its metrics to
Prometheus (moejax.training.prometheus), labelled by process. A workdir on an object store gets
the log and TensorBoard through a local mirror (moejax.storage.Mirror), uploaded at each checkpoint
and at the end.
"""

import json
import logging
import os

import numpy as np
from tensorboardX import SummaryWriter
from tqdm import tqdm

from moejax import storage
from moejax.training.prometheus import MetricsExporter

log = logging.getLogger("moejax.training.monitor")

_LAYER_MAXVIO_SUFFIX = "/maxvio_batch"
_MEAN_MAXVIO = "moe/maxvio_batch"
def to_row(metrics) -> dict:
  """{name: float} for scalars and {name: list of floats} for arrays (flattened)."""
  row = {}
  for name, value in metrics.items():
    a = np.asarray(value)
    row[name] = float(a.reshape(())) if a.size == 1 else [float(v) for v in a.reshape(-1)]
  return row


def _drop_rows_after(path: str, step: int) -> None:
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = f.readlines()
  kept = []
  for line in lines:
    try:
      if json.loads(line).get("step", 0) > step:
        continue
    except json.JSONDecodeError:
      continue  # a line cut short by the kill
    # A kill between a row and its newline leaves a whole row unterminated: the next row appended
    # would join its line.
    kept.append(line if line.endswith("\n") else line + "\n")
  if kept != lines:
    with open(path + ".tmp", "w") as f:
      f.writelines(kept)
    os.replace(path + ".tmp", path)


def _last_rows(path: str) -> tuple[dict, dict]:
  """The last row of a metrics log and its last row with a validation loss ({} where none)."""
  if not os.path.exists(path):
    return {}, {}
  last, last_val = {}, {}
  with open(path) as f:
    for line in f:
      if line.strip():
        last = json.loads(line)
        last_val = last if "val_loss" in last else last_val
  return last, last_val


def summary(workdir: str, row: dict, last_val: dict, trained: dict, checkpoints: list[int],
            total_steps: int) -> str:
  """The closing lines of a run: where it got to, how fast, and where its outputs are.

  `trained`: {"steps", "tokens", "seconds"} of this process, the seconds being the training time of the
  steps whose throughput was measured (compiles, evaluations and saves excluded), and "tokens" theirs."""
  fmt = lambda v: f"{v:.4f}" if isinstance(v, float) and np.isfinite(v) else str(v)
  rate = (f"{trained['tokens'] / trained['seconds']:,.0f} tokens/s" if trained["seconds"] > 0
          else "nothing left to train" if not trained["steps"]
          else "tokens/s not measured (no step past the compiles)")
  ended = "done" if row.get("step", 0) >= total_steps else "stopped"
  lines = [f"{ended}: step {row.get('step', 0)} of {total_steps}; {trained['steps']} steps in this process, "
           f"{rate}"]
  if "loss" in row:
    val = (f", validation loss {fmt(last_val['val_loss'])} at step {last_val.get('step')}" if last_val
           else ", no validation loss yet (train.eval_every)")
    lines.append(f"  train loss   {fmt(row['loss'])} at step {row.get('step')}{val}")
  saved = ", ".join(str(s) for s in checkpoints) or "none"
  lines += [f"  checkpoints  {storage.join(workdir, 'checkpoints')} (steps {saved})",
            f"  metrics      {storage.join(workdir, 'metrics.jsonl')}",
            f"  TensorBoard  tensorboard --logdir {storage.join(workdir, 'tb')}",
            f"  plots        python -m moejax.report --workdir {workdir}"]
  return "\n".join(lines)


def worst_maxvio(row: dict) -> tuple[str, float] | None:
  """(layer, MaxVio_batch) of the most imbalanced MoE layer in a metrics row, or None."""
  layers = {k[:-len(_LAYER_MAXVIO_SUFFIX)]: v for k, v in row.items()
            if k.endswith(_LAYER_MAXVIO_SUFFIX) and k != _MEAN_MAXVIO}
  if not layers and _MEAN_MAXVIO in row:
    layers = {"moe": row[_MEAN_MAXVIO]}
  if not layers:
    return None
  return max(layers.items(), key=lambda kv: kv[1])


class Monitor:
  def __init__(self, workdir: str, config, total_steps: int, start_step: int = 0, writes: bool = True,
               process_index: int = 0):
    self.config = config
    self.writes = writes
    self.last_logged, self.last_val = {}, {}
    if writes:
      self.mirror = storage.Mirror(workdir)
      self.mirror.pull(["metrics.jsonl", "tb/"])
      jsonl = os.path.join(self.mirror.local, "metrics.jsonl")
      _drop_rows_after(jsonl, start_step)
      # What an earlier process of the run logged last, and its last validation ({} if none).
      self.last_logged, self.last_val = _last_rows(jsonl)
      # purge_step makes TensorBoard drop the earlier events at or after it: a killed run's tail.
      self.writer = SummaryWriter(os.path.join(self.mirror.local, "tb"),
                                  purge_step=start_step + 1 if start_step else None)
      self.jsonl = open(jsonl, "a")  # noqa: SIM115 - closed in close()
    port = config.train.get("metrics_port", 0)
    self.exporter = MetricsExporter(port, process_index) if port else None
    self.bar = tqdm(total=total_steps, initial=start_step, disable=not (writes and config.train.progress_bar),
                    dynamic_ncols=True, file=None)
    self.high_maxvio_steps = 0
    self.alerts = 0
    self.skipped = 0  # steps whose update the NaN/Inf guard skipped, in this process

  def record(self, step: int, row: dict) -> None:
    log_now = step % self.config.train.log_every == 0 or "val_loss" in row
    if "val_loss" in row:
      self.last_val = row
    if self.exporter is not None:
      self.exporter.record(step, row)
    if self.writes:
      scalars = {k: v for k, v in row.items() if not isinstance(v, list)}
      self.jsonl.write(json.dumps(row if log_now else scalars) + "\n")
    if self.writes and log_now:
      for k, v in row.items():
        if isinstance(v, list):
          self.writer.add_histogram(k, np.asarray(v), step)
        elif isinstance(v, float) and np.isfinite(v):
          self.writer.add_scalar(k, v, step)
      self.jsonl.flush()
    self.bar.update(1)
    self.bar.set_postfix(loss=f"{row.get('loss', float('nan')):.3f}",
                         maxvio=f"{row.get(_MEAN_MAXVIO, float('nan')):.2f}")
    if not row.get("finite", 1.0):
      self.skipped += 1
      log.warning("step %d: non-finite loss or gradient; update skipped (%d in a row, %d in this run)",
                  step, int(row.get("bad_steps", 0)), self.skipped)
    self._check_maxvio(step, row)

  def flush(self) -> None:
    """Writes out every row recorded so far (metrics.jsonl and TensorBoard, uploaded where the workdir
    is a URL): called before each checkpoint, as a run resumed from it never records those steps
    again."""
    if self.writes:
      self.jsonl.flush()
      self.writer.flush()
      self.mirror.push()

  def checkpoint_saved(self, seconds: float) -> None:
    """The seconds the loop spent handing a checkpoint to orbax (its writing goes on in the background)."""
    if self.exporter is not None:
      self.exporter.checkpoint_saved(seconds)

  def _check_maxvio(self, step: int, row: dict) -> None:
    worst = worst_maxvio(row)
    if worst is None:
      return
    layer, maxvio = worst
    limit, steps = self.config.train.maxvio_alert, self.config.train.maxvio_alert_steps
    self.high_maxvio_steps = self.high_maxvio_steps + 1 if maxvio > limit else 0
    if self.high_maxvio_steps and self.high_maxvio_steps % steps == 0:
      self.alerts += 1
      log.warning("expert-collapse alert at step %d: MaxVio_batch has stayed above %.2f for %d steps "
                  "(now %.2f in %s)", step, limit, self.high_maxvio_steps, maxvio, layer)

  def close(self) -> None:
    self.bar.close()
    if self.writes:
      self.writer.close()
      self.jsonl.close()
      self.mirror.push()
    if self.exporter is not None:
      self.exporter.close()
