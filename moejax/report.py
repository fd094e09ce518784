"""Plots of a run's metrics log in one image.

python -m moejax.report --workdir runs/tiny [--out report.png]

Reads WORKDIR/metrics.jsonl (written by moejax.training.monitor) and writes WORKDIR/report.png: the
train and validation loss, the learning rate, MaxVio_batch of each MoE layer, and for each MoE layer a
heatmap of the per-expert load over the steps (1 = a fair share; logged every train.log_every steps).
With more than `MAX_HEATMAPS` MoE layers, the heatmaps show the most imbalanced ones (highest mean
MaxVio_batch), named in their titles.
"""

import argparse
import json
import os
import sys

import numpy as np

from moejax.storage import resolve_workdir

MAX_HEATMAPS = 8
_MAXVIO = "/maxvio_batch"
_LOAD = "/load"
_MEAN_MAXVIO = "moe/maxvio_batch"


class ReportError(Exception):
  """The workdir or its metrics log cannot make a report."""


def load_rows(workdir: str) -> list[dict]:
  """The rows of WORKDIR/metrics.jsonl in step order; a line cut short by a kill is skipped."""
  if not os.path.isdir(workdir):
    raise ReportError(f"{workdir} is not a directory: pass the --workdir of a moejax.train run")
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    raise ReportError(f"{path} does not exist: {workdir} holds no run's metrics yet (moejax.train writes "
                      f"them from its first step on)")
  rows = []
  with open(path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(row, dict) and "step" in row:
        rows.append(row)
  if not rows:
    raise ReportError(f"{path} holds no metrics rows: the run has not finished a step yet")
  return sorted(rows, key=lambda r: r["step"])


def _layer(key: str, suffix: str) -> str:
  """'moe/layer_3/moe/maxvio_batch' -> 'layer_3'."""
  name = key[len("moe/"):-len(suffix)]
  return name[:-len("/moe")] if name.endswith("/moe") else name


def _series(rows, key):
  points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
  return np.array([p[0] for p in points]), np.array([p[1] for p in points], dtype=float)


def _empty(ax, title, why):
  ax.set_title(title)
  ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="gray")
  ax.set_xticks([])
  ax.set_yticks([])


def write_report(workdir: str, out: str | None = None) -> str:
  """Writes the report image of the run in `workdir` (relative paths are to the current directory)
  to `out` (default WORKDIR/report.png) and returns its path."""
  import matplotlib

  matplotlib.use("Agg")  # files only: no display is needed, or wanted on a training host
  import matplotlib.pyplot as plt
  from matplotlib.colors import TwoSlopeNorm
  from matplotlib.ticker import MaxNLocator

  workdir = resolve_workdir(workdir)
  rows = load_rows(workdir)
  out = os.path.join(workdir, "report.png") if out is None else os.path.abspath(os.path.expanduser(out))
  keys = set().union(*rows)
  maxvio_keys = sorted((k for k in keys if k.startswith("moe/") and k.endswith(_MAXVIO)
                        and k != _MEAN_MAXVIO), key=_natural)
  load_keys = [k for k in keys if k.startswith("moe/") and k.endswith(_LOAD)]

  def imbalance(load_key):
    values = _series(rows, load_key[:-len(_LOAD)] + _MAXVIO)[1]
    return float(np.nanmean(values)) if np.isfinite(values).any() else -1.0

  heat_keys = sorted(sorted(load_keys, key=imbalance, reverse=True)[:MAX_HEATMAPS], key=_natural)

  columns = 3
  heat_rows = -(-len(heat_keys) // 2) if heat_keys else 1
  fig = plt.figure(figsize=(15, 4 + 3.2 * heat_rows), layout="constrained")
  grid = fig.add_gridspec(1 + heat_rows, columns * 2)
  last = rows[-1]
  fig.suptitle(f"{workdir}: step {last['step']}, train loss {last.get('loss', float('nan')):.4f}",
               fontsize=12)

  ax = fig.add_subplot(grid[0, 0:2])
  steps, loss = _series(rows, "loss")
  if len(steps):
    ax.plot(steps, loss, color="tab:blue", lw=0.8, alpha=0.5 if len(steps) > 50 else 1.0, label="train")
    if len(steps) > 50:
      ax.plot(steps, _smooth(loss), color="tab:blue", lw=1.8, label="train (smoothed)")
    val_steps, val = _series(rows, "val_loss")
    if len(val_steps):
      ax.plot(val_steps, val, "o-", color="tab:orange", lw=1.5, ms=4, label="validation")
    ax.set_title("loss")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  else:
    _empty(ax, "loss", "no loss logged")

  ax = fig.add_subplot(grid[0, 2:4])
  steps, lr = _series(rows, "lr")
  if len(steps):
    ax.plot(steps, lr, color="tab:green")
    ax.set_title("learning rate")
    ax.set_xlabel("step")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax.grid(alpha=0.3)
  else:
    _empty(ax, "learning rate", "no lr logged")

  ax = fig.add_subplot(grid[0, 4:6])
  if maxvio_keys:
    colors = plt.colormaps["viridis"](np.linspace(0, 0.9, len(maxvio_keys)))
    for key, color in zip(maxvio_keys, colors, strict=True):
      ax.plot(*_series(rows, key), lw=1.0, color=color, label=_layer(key, _MAXVIO))
    if _MEAN_MAXVIO in keys:
      ax.plot(*_series(rows, _MEAN_MAXVIO), "k--", lw=1.2, label="mean")
    ax.set_title("MaxVio_batch per MoE layer")
    ax.set_xlabel("step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if len(maxvio_keys) <= 12:
      ax.legend(fontsize=7, ncol=2)
  else:
    _empty(ax, "MaxVio_batch per MoE layer", "no MoE metrics logged")

  for i, key in enumerate(heat_keys):
    ax = fig.add_subplot(grid[1 + i // 2, (i % 2) * columns:(i % 2 + 1) * columns])
    logged = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), list)]
    load = np.array([v for _, v in logged], dtype=float).T  # experts x logged steps
    steps = np.array([s for s, _ in logged])
    vmax = max(2.0, float(np.nanmax(load)))
    edges = _edges(steps)
    image = ax.pcolormesh(edges, np.arange(load.shape[0] + 1) - 0.5, load, cmap="RdBu_r",
                          norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax), shading="flat")
    ax.set_title(f"per-expert load, {_layer(key, _LOAD)} (1 = fair share)", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("expert")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(image, ax=ax, fraction=0.04)
  if not heat_keys:
    _empty(fig.add_subplot(grid[1, :]), "per-expert load", "no per-expert load logged (MoE layers log it "
                                                           "every train.log_every steps)")
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def _natural(key: str):
  """layer_2 before layer_10."""
  parts = key.replace("/", "_").split("_")
  return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in parts]


def _smooth(values: np.ndarray) -> np.ndarray:
  """A centred moving mean over about a fiftieth of the run, NaNs (skipped steps) left out."""
  width = max(3, len(values) // 50)
  finite = np.isfinite(values)
  kernel = np.ones(width)
  total = np.convolve(np.where(finite, values, 0.0), kernel, mode="same")
  count = np.convolve(finite.astype(float), kernel, mode="same")
  with np.errstate(invalid="ignore", divide="ignore"):
    return total / count


def _edges(steps: np.ndarray) -> np.ndarray:
  """Cell edges halfway between logged steps, so each cell is centred on its step."""
  if len(steps) == 1:
    return np.array([steps[0] - 0.5, steps[0] + 0.5])
  gaps = np.diff(steps)
  return np.concatenate([[steps[0] - gaps[0] / 2], steps[:-1] + gaps / 2, [steps[-1] + gaps[-1] / 2]])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m moejax.report", description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", required=True, help="the --workdir of a moejax.train run")
  parser.add_argument("--out", default=None, help="image path (default: WORKDIR/report.png)")
  args = parser.parse_args(argv)
  try:
    path = write_report(args.workdir, args.out)
  except ReportError as e:
    sys.exit(f"moejax.report: {e}")
  print(path)


if __name__ == "__main__":
  main()
