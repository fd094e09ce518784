"""benchmarks/balance_gpu.py's reading of a run's metrics: the settling step, the summary and the plot,
on metrics rows made up here (the runs themselves are the training loop's, tested in tests/training)."""

import numpy as np
import pytest

from benchmarks import balance_gpu


@pytest.mark.parametrize("worst, settled", [
    ([0.9, 0.4, 0.6, 0.3, 0.2], 4),  # dips below at step 2 but rises again: settles at 4
    ([0.3, 0.2, 0.1], 1),  # below from the first step
    ([0.3, 0.2, 0.7], None),  # above at the end: not settled
    ([0.9, 0.5, 0.49], 3),  # 0.5 itself is not below 0.5
])
def test_settling_step(worst, settled):
  steps = np.arange(1, len(worst) + 1)
  assert balance_gpu.settling_step(np.array(worst), steps) == settled


def made_up_rows(steps=60, layers=(1, 2, 3), experts=4, seed=0):
  """Metrics rows as the training loop writes them: per-layer MaxVio every step, loads at every 10th,
  a validation loss at the end."""
  rng = np.random.default_rng(seed)
  rows = []
  for s in range(1, steps + 1):
    row = {"step": s, "loss": 5.0 - s / steps, "moe/dropped": 0.0, "moe/maxvio_global": 1.0 / s}
    for i in layers:
      row[f"moe/layer_{i}/moe/maxvio_batch"] = float(i / s + 0.01 * rng.random())
      if s % 10 == 0:
        row[f"moe/layer_{i}/moe/load"] = list(1 + 0.1 * rng.standard_normal(experts))
    rows.append(row)
  rows[-1]["val_loss"] = 4.2
  return rows


def test_summary_reads_the_worst_layer_after_the_warmup():
  rows = made_up_rows()
  # Layer order by number, not as text: layer_10 after layer_2.
  assert balance_gpu.layer_names({"moe/layer_10/moe/maxvio_batch": 0, "moe/layer_2/moe/maxvio_batch": 0}) == [
      "moe/layer_2/moe", "moe/layer_10/moe"]
  r = balance_gpu.summarise(rows)
  worst = np.array([row["moe/layer_3/moe/maxvio_batch"] for row in rows])  # layer 3's i / s is the largest
  later = worst[balance_gpu.FROM_STEP - 1:]
  assert r["worst_median"] == pytest.approx(np.median(later)) and r["worst_max"] == pytest.approx(later.max())
  assert r["step"] == 60 and r["global_end"] == pytest.approx(1 / 60) and r["dropped"] == 0
  assert r["val_loss"] == 4.2 and r["val_step"] == 60
  assert r["settled_at"] == 7  # 3 / s + noise < 0.5 from s = 7 on
  assert r["loss_end"] == pytest.approx(np.mean([5 - s / 60 for s in range(51, 61)]))


def test_table_marks_a_run_cut_short_and_the_plot_is_written(tmp_path):
  runs = {("h200", "quantile"): made_up_rows(), ("h200", "sign"): made_up_rows(steps=40, seed=1)}
  runs["h200", "sign"][-1].pop("val_loss")
  lines = balance_gpu.table({k: balance_gpu.summarise(v) for k, v in runs.items()}, steps=60)
  assert lines[2].startswith("| h200 | quantile | 60 |"), lines
  assert lines[3].startswith("| h200 | sign | 40 of 60 (cut short) |") and lines[3].endswith("| n/a |"), lines
  balance_gpu.plot(runs, tmp_path / "balance.png")
  assert (tmp_path / "balance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
