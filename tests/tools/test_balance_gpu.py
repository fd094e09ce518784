"""benchmarks/balance_gpu.py's reading of a run's metrics: the settling step, the summary and the plot,
on metrics rows made up here (the runs themselves are the training loop's, tested in tests/training)."""

import json
import os

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


def test_the_runs_resume_across_calls_and_frozen_continues_quantile(tmp_path, monkeypatch, capsys):
  """Two calls of the benchmark (--smoke: the tiny model on the CPU). The first stops quantile at its
  time limit (the first logged step past it); the second resumes it to the end, then runs frozen from
  quantile's last checkpoint for --frozen-steps more, and deletes both runs' checkpoints once done."""
  from benchmarks import balance

  monkeypatch.chdir(tmp_path)  # relative paths, as a user types them
  monkeypatch.setenv("MOEJAX_CACHE_DIR", str(tmp_path / "cache"))
  common = ["--gpu", "--smoke", "--steps", "10", "--frozen-steps", "5", "--modes", "frozen,quantile",
            "--workdir", "runs/balance", "--json", "figures.json", "--min-run-s", "0"]

  def call(limit):
    monkeypatch.setattr("sys.argv", ["balance", *common, "--time-limit-s", str(limit)])
    balance.main()
    return json.loads((tmp_path / "figures.json").read_text()), capsys.readouterr().out

  figures, out = call(5)  # compiling alone takes longer: it stops at step 5, the first logged
  assert list(figures) == ["h200 quantile"] and figures["h200 quantile"]["step"] == 5
  assert "| h200 | quantile | 5 of 10 (cut short) |" in out and "the same command resumes" in out
  assert os.listdir("runs/balance/h200/quantile/checkpoints") == ["5"]

  figures, out = call(600)
  assert figures["h200 quantile"]["step"] == 10
  frozen = figures["h200 frozen"]
  assert (frozen["first"], frozen["step"]) == (11, 15) and frozen["dropped"] == 0
  assert "| h200 | frozen | 11-15 |" in out and "training tokens: 10 steps pass over it" in out
  assert "median over steps 6-10 of quantile (content and lag)" in out
  assert "over steps 11-15 with the router frozen (content alone)" in out
  for mode in ("quantile", "frozen"):
    assert not os.path.exists(f"runs/balance/h200/{mode}/checkpoints"), mode


def test_frozen_without_quantiles_checkpoint_says_why(tmp_path):
  (tmp_path / "quantile").mkdir()
  assert "has not reached step 20" in balance_gpu.start_frozen(str(tmp_path), 20)
  (tmp_path / "quantile" / "metrics.jsonl").write_text(json.dumps({"step": 20, "loss": 1.0}) + "\n")
  assert "which is gone" in balance_gpu.start_frozen(str(tmp_path), 20)
  order = balance_gpu.order_modes(["sign", "frozen", "aux", "quantile"])
  assert order == ["sign", "aux", "quantile", "frozen"]


def test_persistence_tells_a_lasting_excess_from_a_batchs_own():
  rng = np.random.default_rng(0)
  steps = range(10, 1010, 10)

  def rows(loads):
    return [{"step": s, "loss": 1.0, "moe/layer_1/moe/maxvio_batch": 0.0, "moe/layer_1/moe/load": list(load)}
            for s, load in zip(steps, loads, strict=True)]

  noise = 1 + 0.3 * rng.standard_normal((len(steps), 16))
  assert abs(balance_gpu.persistence(rows(noise))) < 0.1
  # A slowly wandering excess (an AR(1) of coefficient 0.9 per logging interval), as a lagging bias leaves.
  lasting = np.zeros((len(steps), 16))
  for t in range(1, len(steps)):
    lasting[t] = 0.9 * lasting[t - 1] + 0.1 * rng.standard_normal(16)
  assert balance_gpu.persistence(rows(1 + lasting)) > 0.7
