"""The notebooks run top to bottom (their code cells in order, in a fresh interpreter), shortened."""

import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def code_cells(name):
  notebook = json.loads((ROOT / "notebooks" / name).read_text())
  return ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]


def test_quickstart_notebook_runs(tmp_path):
  cells = code_cells("quickstart.ipynb")
  assert cells[0].startswith("STEPS = "), "the first code cell sets STEPS and WORKDIR"
  cells[0] = f"STEPS = 6\nWORKDIR = {str(tmp_path / 'run')!r}"
  env = dict(os.environ, MOEJAX_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  out = subprocess.run([sys.executable, "-c", "\n\n".join(cells)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1200)
  assert out.returncode == 0, out.stderr[-4000:]
  assert re.search(r"loss: first 5 steps \d+\.\d+, last 5 steps \d+\.\d+", out.stdout), out.stdout
  assert "step 6 moe/layer_1/moe/load:" in out.stdout, out.stdout
  diffs = re.search(r"max \|chunked - recurrent\|: (\S+) (\S+)", out.stdout)
  assert diffs and max(float(diffs[1]), float(diffs[2])) < 1e-4, out.stdout
