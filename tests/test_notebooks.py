"""The notebooks run top to bottom (their code cells in order, in a fresh interpreter), shortened."""

import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def code_cells(name):
  notebook = json.loads((ROOT / "notebooks" / name).read_text())
  return ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]


def test_quickstart_notebook_runs(tmp_path):
  cells = code_cells("quickstart.ipynb")
  assert "MOEJAX_REPO" in cells[0], "the first code cell installs moejax where it is not importable"
  assert cells[1].startswith("STEPS = "), "the second code cell sets STEPS and WORKDIR"
  cells[1] = f"STEPS = 6\nWORKDIR = {str(tmp_path / 'run')!r}"
  env = dict(os.environ, MOEJAX_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  out = subprocess.run([sys.executable, "-c", "\n\n".join(cells)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1200)
  assert out.returncode == 0, out.stderr[-4000:]
  assert re.search(r"loss: first 5 steps \d+\.\d+, last 5 steps \d+\.\d+", out.stdout), out.stdout
  assert "step 6 moe/layer_1/moe/load:" in out.stdout, out.stdout
  diffs = re.search(r"max \|chunked - recurrent\|: (\S+) (\S+)", out.stdout)
  assert diffs and max(float(diffs[1]), float(diffs[2])) < 1e-4, out.stdout
