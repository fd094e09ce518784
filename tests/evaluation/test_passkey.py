"""Passkey prompts are exactly their length with the key at its depth; a model that copies the key from
its context by construction scores 1.0, one that answers another number 0.0, and a real model's greedy
answers come back in the table's shape."""

import os
import re

import numpy as np
import pytest

from moejax.config import load_experiment
from moejax.data import tokenizer as tk
from moejax.evaluation import passkey
from moejax.inference import random_model
from moejax.inference.loading import TextTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tokenizer():
  texts = [passkey.INTRO, passkey.FILLER, passkey.NEEDLE.format(key="12345"), passkey.QUESTION,
           " ".join(str(n) for n in range(2000))] * 4
  return TextTokenizer(tk.train_tokenizer(texts, 600))


@pytest.mark.parametrize("length", [150, 257, 1000])
def test_prompts_have_their_length_and_the_key_at_its_depth(tokenizer, length):
  starts = []
  for depth in (0.0, 0.3, 1.0):
    ids, at = passkey.prompt(tokenizer, length, depth, "40417")
    assert len(ids) == length and ids[0] == tokenizer.bos_id
    needle = tokenizer.encode(passkey.NEEDLE.format(key="40417"), bos=False)
    assert ids[at:at + len(needle)] == needle
    assert tokenizer.decode(ids).endswith(passkey.QUESTION)
    starts.append(at)
  assert starts == sorted(starts) and starts[0] < starts[-1]
  with pytest.raises(ValueError, match="at least"):
    passkey.prompt(tokenizer, 20, 0.5, "40417")


class Model:
  """What passkey_accuracy reads of a model: its tokenizer (answers come from `answer`)."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer


def test_a_copying_model_scores_one_and_a_wrong_one_zero(tokenizer):
  def copy(prompts, n):  # reads the key where the needle states it
    keys = [re.search(r"The pass key is (\d+)\.", tokenizer.decode(p)).group(1) for p in prompts]
    return [tokenizer.encode(f" {k}.", bos=False)[:n] for k in keys]

  r = passkey.passkey_accuracy(Model(tokenizer), [150, 400], [0.0, 0.5, 1.0], trials=3, answer=copy)
  assert r["accuracy"] == 1.0
  assert [row["length"] for row in r["lengths"]] == [150, 400]
  assert all(len(row["depths"]) == 3 and len(row["depths"][0]["answers"]) == 3 for row in r["lengths"])
  seven = lambda prompts, n: [tokenizer.encode(" 7.", bos=False)] * len(prompts)
  wrong = passkey.passkey_accuracy(Model(tokenizer), [150], [0.5], trials=4, answer=seven)
  assert wrong["accuracy"] == 0.0
  assert passkey.first_number("is 123. Or 456") == "123" and passkey.first_number("none") is None


def test_a_model_answers_greedily(tokenizer):
  c = load_experiment(os.path.join(ROOT, "experiments", "tiny.py"))
  lm = random_model(c, tokenizer=tokenizer, cache_len=512)
  r = passkey.passkey_accuracy(lm, [130, 300], [0.0, 1.0], trials=1, batch=3)
  assert 0.0 <= r["accuracy"] <= 1.0
  answers = [a for row in r["lengths"] for d in row["depths"] for a in d["answers"]]
  assert len(answers) == 4 and all(isinstance(a, str) for a in answers)
  assert np.isclose(r["accuracy"], np.mean([d["accuracy"] for row in r["lengths"] for d in row["depths"]]))
