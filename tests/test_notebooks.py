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


def run_cells(cells, **env_vars):
  """The code cells, joined, in a fresh CPU interpreter from the repository root; its stdout. Fails the
  test with the end of stderr if the cells raise."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg", **env_vars)
  env.pop("JAX_NUM_CPU_DEVICES", None)
  out = subprocess.run([sys.executable, "-c", "\n\n".join(cells)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1200)
  assert out.returncode == 0, out.stderr[-4000:]
  return out.stdout


def test_quickstart_then_generate_and_long_context_notebooks_run(tmp_path):
  """The quickstart notebook trains a few steps; the generation notebook then loads that run (as it
  loads the Quickstart's) and generates from it, and the long-context notebook trains MQAR a few steps,
  tabulates it by length and plots that run's loss by position."""
  cells = code_cells("quickstart.ipynb")
  assert "MOEJAX_REPO" in cells[0], "the first code cell installs moejax where it is not importable"
  assert cells[1].startswith("STEPS = "), "the second code cell sets STEPS and WORKDIR"
  cells[1] = f"STEPS = 6\nWORKDIR = {str(tmp_path / 'run')!r}"
  out = run_cells(cells, MOEJAX_CACHE_DIR=str(tmp_path / "cache"))
  assert re.search(r"loss: first 5 steps \d+\.\d+, last 5 steps \d+\.\d+", out), out
  assert "step 6 moe/layer_1/moe/load:" in out, out
  diffs = re.search(r"max \|chunked - recurrent\|: (\S+) (\S+)", out)
  assert diffs and max(float(diffs[1]), float(diffs[2])) < 1e-4, out

  cells = code_cells("generate.ipynb")
  assert "MOEJAX_REPO" in cells[0], "the first code cell installs moejax where it is not importable"
  assert cells[1].startswith("WORKDIR = "), "the second code cell sets WORKDIR"
  cells[1] = f"WORKDIR = {str(tmp_path / 'run')!r}"
  out = run_cells(cells, MOEJAX_CACHE_DIR=str(tmp_path / "cache"))
  assert "step 6, vocabulary" in out, out
  assert "greedy tokens equal the argmax of the full forward pass" in out, out
  assert "the second turn equals one pass over the whole history" in out, out

  cells = code_cells("long_context.ipynb")
  assert "MOEJAX_REPO" in cells[0], "the first code cell installs moejax where it is not importable"
  assert cells[1].startswith("STEPS = "), "the second code cell sets STEPS, WORKDIR and TEXT_WORKDIR"
  cells[1] = f"STEPS = 3\nWORKDIR = {str(tmp_path / 'mqar')!r}\nTEXT_WORKDIR = {str(tmp_path / 'run')!r}"
  out = run_cells(cells, MOEJAX_CACHE_DIR=str(tmp_path / "cache"))
  assert re.search(r"^\s+4096\s+128\s+\d\.\d{3}$", out, re.M), out
  assert re.search(r"positions \[ 256,  512\): loss \d+\.\d{4}", out), out


def test_rl_notebook_runs(tmp_path):
  """The RL notebook runs a shortened rl_tiny run, plots it and plays a task before and after RL."""
  cells = code_cells("rl.ipynb")
  assert "MOEJAX_REPO" in cells[0], "the first code cell installs moejax where it is not importable"
  assert cells[1].startswith("WORKDIR = "), "the second code cell sets WORKDIR and OVERRIDES"
  overrides = {"rl.sft.steps": 12, "rl.sft.examples": 32, "rl.grpo.iterations": 2, "rl.grpo.groups": 2,
               "rl.grpo.group_size": 2, "rl.eval.tasks": 2, "rl.eval.every": 2, "rl.checkpoint_every": 1}
  cells[1] = f"WORKDIR = {str(tmp_path / 'rl')!r}\nOVERRIDES = {overrides!r}"
  out = run_cells(cells)
  assert re.search(r"pass rate after SFT \d\.\d{3}, after 2 iterations \d\.\d{3}", out), out
  assert "--- after SFT (step 12)" in out and "--- after RL (step 14)" in out, out
  assert out.count("Task: ") == 2, out


def test_vision_notebook_runs(tmp_path):
  """The vision notebook trains a few steps of vision_tiny, shows what images become, and captions."""
  cells = code_cells("vision.ipynb")
  assert "MOEJAX_REPO" in cells[0], "the first code cell installs moejax where it is not importable"
  assert cells[1].startswith("WORKDIR = "), "the second code cell sets WORKDIR and OVERRIDES"
  overrides = {"train.stages": ((128, 4, 512),), "train.eval_every": 0}
  cells[1] = f"WORKDIR = {str(tmp_path / 'vision')!r}\nOVERRIDES = {overrides!r}"
  out = run_cells(cells, MOEJAX_CACHE_DIR=str(tmp_path / "cache"))
  assert "trained to step 4" in out, out
  assert re.search(r"digits: 16x16 pixels -> 4x4 patches of 4x4 -> 4 decoder tokens", out), out
  assert re.search(r"digits accuracy \d\.\d{3} over 24, shapes accuracy \d\.\d{3} over 24", out), out

