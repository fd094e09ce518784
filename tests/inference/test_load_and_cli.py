"""A run's workdir is enough to generate: load_model restores its weights and tokenizer, and the CLI
streams a prompt and runs a JSONL batch from it. Errors name what is missing."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moejax.config import load_experiment
from moejax.inference import generate, load_model
from moejax.training.loop import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A tiny run of 2 steps with a checkpoint at each."""
  c = load_experiment(os.path.join(ROOT, "experiments", "tiny.py"))
  c.train.stages = ((128, 2, 256),)
  c.train.update(checkpoint_every=1, eval_every=0, progress_bar=False)
  path = str(tmp_path_factory.mktemp("run"))
  run(c, path)
  return path


def test_load_model_restores_the_run(workdir):
  lm = load_model(workdir)
  assert lm.step == 2 and lm.cache_len == 128
  assert lm.tokenizer.decode(lm.tokenizer.encode("def f(x):\n  return x")) == "def f(x):\n  return x"
  assert lm.logits(lm.tokenizer.encode("import os"))[-1].shape == (lm.vocab_size,)
  earlier = load_model(workdir, step=1)
  assert earlier.step == 1
  a, b = lm.logits([1, 5, 9]), earlier.logits([1, 5, 9])
  assert np.all(np.isfinite(a)) and not np.allclose(a, b)  # two checkpoints, two sets of weights
  out = generate(lm, [lm.tokenizer.encode("x = ")], max_new_tokens=3)
  assert len(out.tokens[0]) == 3
  with pytest.raises(FileNotFoundError, match="no checkpoint of step 7"):
    load_model(workdir, step=7)


def test_load_model_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_model(str(tmp_path))
  with open(tmp_path / "config.json", "w") as f:
    json.dump(load_experiment(os.path.join(ROOT, "experiments", "tiny.py")).to_dict(), f)
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    load_model(str(tmp_path))


def test_cli_streams_and_runs_a_batch(workdir, tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "def f(x):"}\n\n{"prompt": "import"}\n')
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "moejax.generate", "--workdir", workdir, "--max-new-tokens", "4"]
  out = subprocess.run(cmd + ["--prompts-file", str(prompts), "--output", str(tmp_path / "out.jsonl")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
  assert [r["prompt"] for r in lines] == ["def f(x):", "import"]
  assert all(len(r["tokens"]) == len(r["logprobs"]) <= 4 and r["finish_reason"] in ("eos", "length")
             for r in lines)
  out = subprocess.run(cmd + ["--prompt", "def f(x):", "--temperature", "0.7", "--top-k", "20"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "tokens, " in out.stderr
  bad = subprocess.run(cmd + ["--prompts-file", str(tmp_path / "missing.jsonl")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
  assert bad.returncode != 0
