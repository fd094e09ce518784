"""`python -m moejax.train` as a user first runs it: the README's Quickstart command as written (its
relative --workdir included), shortened by config overrides, what its console shows, its resume, and
the settings it gives the accelerator's allocator before JAX starts."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

from moejax.device_memory import ALLOCATOR_VARIABLES, default_memory_fraction

REPO = pathlib.Path(__file__).resolve().parents[2]
# Each run a few steps of 64 tokens: two evaluations and two checkpoints in the first.
SHORT = ["--config.train.eval_every=2", "--config.train.eval_batches=1", "--config.train.checkpoint_every=2",
         "--config.train.log_every=2"]


def readme_train_command() -> str:
  """The part after `&&` of the README Quickstart's line that runs `-m moejax.train`."""
  readme = (REPO / "README.md").read_text()
  section = re.search(r"^#+ Quickstart\s*$(.*?)(?=^#+ |\Z)", readme, re.S | re.M)
  assert section, "README.md has no Quickstart section"
  blocks = re.findall(r"```[\w-]*\n(.*?)```", section.group(1), re.S)
  lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
  line = next((line for line in lines if "-m moejax.train" in line), None)
  assert line and "&&" in line, f"no `setup && ... -m moejax.train ...` line in the Quickstart: {lines}"
  return line.split("&&", 1)[1].strip()


def _env(**extra) -> dict:
  """The child imports this checkout (it runs outside the repository root), on the CPU."""
  env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                          env.get("PYTHONPATH")])))
  env.update(extra)
  return env


def _run(args, cwd, env) -> str:
  out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, f"{shlex.join(args)} failed:\n{out.stderr[-4000:]}"
  return out.stderr + out.stdout


def _workdir(args) -> str:
  for i, arg in enumerate(args):
    if arg == "--workdir":
      return args[i + 1]
    if arg.startswith("--workdir="):
      return arg.split("=", 1)[1]
  raise AssertionError(f"no --workdir in {args}")


def test_readme_quickstart_trains_resumes_and_reads_well(tmp_path):
  """The command from a fresh directory holding only experiments/, with the data cache relative to it
  too: it trains, checkpoints, shows only our lines (no absl/orbax INFO), and a second start with a
  longer stage resumes from its last checkpoint; --verbose brings the third-party logs back."""
  args = shlex.split(readme_train_command())
  assert args[0].endswith("python") and args[1:3] == ["-m", "moejax.train"], args
  workdir = _workdir(args)
  assert not os.path.isabs(workdir), "the Quickstart's --workdir was meant to be relative"
  (tmp_path / "experiments").symlink_to(REPO / "experiments")
  env = _env(MOEJAX_CACHE_DIR="cache",  # relative, like the workdir
             JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  command = [sys.executable, *args[1:], *SHORT]

  first = _run(command + ["--config.train.stages=((64, 4, 512),)"], tmp_path, env)
  run_dir = tmp_path / workdir
  assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4"]
  assert list((tmp_path / "cache" / "data").glob("*/manifest.json"))
  assert not re.search(r"^[IWE]\d{4} ", first, re.M), first  # absl's own format: file:line INFO
  assert "orbax" not in first.lower() and "CheckpointManager" not in first, first
  for step in (2, 4):
    assert len(re.findall(rf"step {step}: validation loss \d", first)) == 1, first
    saved = rf"step {step}: checkpoint to \S*{re.escape(workdir)}/checkpoints/{step}"
    assert len(re.findall(saved, first)) == 1, first
  assert "done: step 4 of 4" in first and f"{workdir}/metrics.jsonl" in first, first
  assert "tensorboard --logdir" in first

  second = _run(command + ["--config.train.stages=((64, 6, 512),)", "--verbose"], tmp_path, env)
  assert "resumed from step 4" in second and "done: step 6 of 6" in second, second
  assert re.search(r"^\d\d:\d\d:\d\d I (absl|orbax|grain)", second, re.M), second  # --verbose
  with open(run_dir / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4, 5, 6]
  assert sorted(os.listdir(run_dir / "checkpoints")) == ["2", "4", "6"]


def test_train_entry_sets_the_memory_fraction_before_jax_starts(tmp_path):
  """XLA's share of the GPU is set before the config file (the first code the entry runs) and JAX's
  backend; a user's own allocator setting is kept."""
  probe = tmp_path / "probe.py"
  probe.write_text("import os\nimport sys\n\nfrom jax._src import xla_bridge\n\n\ndef get_config():\n"
                   "  print('PROBE', os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'),\n"
                   "        xla_bridge.backends_are_initialized(), file=sys.stderr)\n"
                   "  sys.exit(3)\n")
  for extra, want in (({}, str(default_memory_fraction())), ({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}, ".5")):
    out = subprocess.run([sys.executable, "-m", "moejax.train", f"--config={probe}", "--workdir=w"],
                         cwd=tmp_path, env=_env(**extra), capture_output=True, text=True, timeout=300)
    assert f"PROBE {want} False" in out.stderr, out.stderr[-3000:]
