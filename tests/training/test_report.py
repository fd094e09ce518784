"""`python -m moejax.report`: the image of a run's metrics, from the reference run's metrics log."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import test_train
from PIL import Image

from moejax import report

# test_train's reference run (28 steps, two MoE layers, validation at 10 and 20) and what it needs.
shared, compilation_cache_dir = test_train.shared, test_train.compilation_cache_dir
reference = test_train.reference


def test_report_of_a_tiny_run(reference, tmp_path):
  """From a relative --workdir, as a user runs it: WORKDIR/report.png, a real picture (many colours,
  not a blank canvas) of a sensible size."""
  (tmp_path / "run").mkdir()
  shutil.copy(os.path.join(reference["workdir"], "metrics.jsonl"), tmp_path / "run" / "metrics.jsonl")
  repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
  out = subprocess.run([sys.executable, "-m", "moejax.report", "--workdir", "run"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  path = tmp_path / "run" / "report.png"
  assert out.stdout.strip() == str(path)
  with Image.open(path) as image:
    assert image.format == "PNG" and 1000 <= image.width <= 3000 and 700 <= image.height <= 3000
    pixels = np.asarray(image.convert("RGB")).reshape(-1, 3)
  colours = np.unique(pixels, axis=0)
  assert len(colours) > 100, len(colours)  # lines, text and the heatmaps' colour scales
  # The load heatmaps' diverging scale: red (overloaded) and blue (underloaded) regions.
  red = (pixels[:, 0] > 180) & (pixels[:, 2] < 150)
  blue = (pixels[:, 2] > 180) & (pixels[:, 0] < 150)
  assert red.sum() > 500 and blue.sum() > 500, (red.sum(), blue.sum())


def test_report_errors_name_the_problem(tmp_path):
  with pytest.raises(report.ReportError, match="is not a directory"):
    report.write_report(str(tmp_path / "missing"))
  with pytest.raises(report.ReportError, match="metrics.jsonl does not exist"):
    report.write_report(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text("")
  with pytest.raises(report.ReportError, match="holds no metrics rows"):
    report.write_report(str(tmp_path))
  with pytest.raises(SystemExit, match="moejax.report: .*missing is not a directory"):
    report.main(["--workdir", str(tmp_path / "missing")])


def test_report_without_moe_metrics_or_validation(tmp_path):
  """A run without MoE layers or evaluation still gets its loss and learning-rate plots."""
  rows = [f'{{"step": {s}, "loss": {5.0 - 0.01 * s}, "lr": {1e-3 * min(1, s / 10)}}}' for s in range(1, 80)]
  (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"step": 80, "lo')  # a killed run's cut row
  path = report.write_report(str(tmp_path), out=str(tmp_path / "plain.png"))
  with Image.open(path) as image:
    assert image.width > 1000
