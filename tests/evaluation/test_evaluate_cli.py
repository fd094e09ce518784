"""`python -m moejax.evaluate` on tiny runs: each task prints its table and a JSON last line of the
documented shape; bad arguments and a task the run cannot take fail with their reason."""

import json
import os

import pytest

from moejax import evaluate
from moejax.config import load_experiment
from moejax.training.loop import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(tmp_path_factory, experiment, **mqar):
  """Two steps of a tiny run, with the shapes (and so the compiled programs) of the generation tests' run
  (tests/inference/test_load_and_cli.py): the MQAR run keeps tiny's vocabulary for that."""
  c = load_experiment(os.path.join(ROOT, "experiments", experiment))
  c.train.stages = ((128, 2, 256),)
  c.train.update(checkpoint_every=1, eval_every=0, progress_bar=False)
  c.data.vocab_size = 1024
  c.data.mqar.update(mqar)
  path = str(tmp_path_factory.mktemp(experiment.removesuffix(".py")))
  run(c, path)
  return path


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
  return train(tmp_path_factory, "tiny.py")


@pytest.fixture(scope="module")
def mqar_run(tmp_path_factory):
  return train(tmp_path_factory, "mqar_tiny.py", pairs=4)


def last_json(capsys):
  out = capsys.readouterr().out.strip().splitlines()
  return out, json.loads(out[-1])


def test_ppl_and_passkey_on_a_text_run(text_run, capsys):
  assert evaluate.main(["--workdir", text_run, "--task", "ppl", "--lengths", "100", "--limit", "2"]) == 0
  lines, r = last_json(capsys)
  assert r["task"] == "ppl" and r["step"] == 2
  (row,) = r["lengths"]
  assert row["length"] == 100 and row["documents"] == 2 and row["tokens"] == 200
  assert [(b["start"], b["end"]) for b in row["buckets"]] == [(0, 64), (64, 100)]
  assert any("positions [" in line for line in lines)
  assert evaluate.main(["--workdir", text_run, "--task", "passkey", "--lengths", "400", "--depths", "0,1",
                        "--trials", "1"]) == 0
  _, r = last_json(capsys)
  assert [len(row["depths"]) for row in r["lengths"]] == [2] and 0.0 <= r["accuracy"] <= 1.0
  with pytest.raises(ValueError, match="not trained on MQAR"):
    evaluate.main(["--workdir", text_run, "--task", "mqar", "--lengths", "64"])


def test_mqar_on_an_mqar_run(mqar_run, capsys):
  assert evaluate.main(["--workdir", mqar_run, "--task", "mqar", "--lengths", "64,200", "--examples", "3",
                        "--piece", "32"]) == 0
  _, r = last_json(capsys)
  got = [(row["length"], row["examples"], row["queries"]) for row in r["lengths"]]
  assert got == [(64, 3, 12), (200, 3, 12)]
  assert all(0.0 <= row["accuracy"] <= 1.0 for row in r["lengths"])
  with pytest.raises(ValueError, match="no documents"):
    evaluate.main(["--workdir", mqar_run, "--task", "ppl", "--lengths", "64"])
  with pytest.raises(ValueError, match="text tokenizer"):
    evaluate.main(["--workdir", mqar_run, "--task", "passkey", "--lengths", "300"])


@pytest.mark.parametrize("argv", [["--lengths", "0"], ["--depths", "1.5"], ["--lengths", "a,b"],
                                  ["--task", "nope"], ["--examples", "0"], ["--output", "x.jsonl"]])
def test_bad_arguments(argv, tmp_path):
  args = {"--workdir": str(tmp_path), "--task": "mqar"}
  for flag, value in zip(argv[::2], argv[1::2], strict=True):
    args[flag] = value
  with pytest.raises(SystemExit):
    evaluate.main([x for kv in args.items() for x in kv])
