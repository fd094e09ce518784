"""Scoring through the prefill path gives the plain forward's numbers: per-position losses and greedy
predictions, over pieces that do not divide the rows, for rows of different lengths, with NoPE, with
RoPE and with the unbounded KDA gate. Loss by position is the plain forward's loss averaged in the
same buckets."""

import os

import jax
import numpy as np
import pytest

from moejax.config import load_experiment
from moejax.evaluation.perplexity import bucket_edges, bucket_means, bucket_sums, loss_by_position
from moejax.evaluation.scoring import score_rows
from moejax.inference import random_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = {
    "nope": {},
    "rope": {"model.mla.rope_head_dim": 8},
    "unbounded_gate": {"model.kda.gate": "unbounded", "model.kda.implementation": "recurrent"},
}


def tiny(overrides):
  c = load_experiment(os.path.join(ROOT, "experiments", "tiny.py"))
  c.update_from_flattened_dict(overrides)
  return c


def plain_nll(lm, tokens, targets):
  logits = lm.logits(tokens)
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  return -logp[np.arange(len(targets)), targets], logits.argmax(-1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pieces_match_the_plain_forward(variant):
  lm = random_model(tiny(VARIANTS[variant]), seed=3)
  rng = np.random.default_rng(0)
  lengths = np.array([45, 21, 0])
  tokens = rng.integers(3, lm.vocab_size, (3, 45)).astype(np.int32)
  targets = rng.integers(3, lm.vocab_size, (3, 45)).astype(np.int32)
  scores = score_rows(lm, tokens, targets, lengths, piece=16)
  for b, n in enumerate(lengths):
    if n == 0:
      assert np.all(scores.nll_BT[b] == 0) and np.all(scores.argmax_BT[b] == -1)
      continue
    nll, top = plain_nll(lm, tokens[b, :n], targets[b, :n])
    np.testing.assert_allclose(scores.nll_BT[b, :n], nll, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(scores.argmax_BT[b, :n], top)
    assert np.all(scores.nll_BT[b, n:] == 0)


def test_loss_by_position_averages_the_plain_forward_in_buckets():
  lm = random_model(tiny({}), seed=1)
  rng = np.random.default_rng(1)
  docs = [rng.integers(3, lm.vocab_size, n).astype(np.int32) for n in (150, 131, 200)]
  length = 130
  r = loss_by_position(lm, docs, length, batch=2, piece=32)
  edges = bucket_edges(length)
  assert edges == [0, 64, 128, 130] and [b["start"] for b in r["buckets"]] == [0, 64, 128]
  nll = np.stack([plain_nll(lm, d[:length], d[1:length + 1])[0] for d in docs])
  for got, start, end in zip(r["buckets"], edges[:-1], edges[1:], strict=True):
    assert got["tokens"] == 3 * (end - start)
    np.testing.assert_allclose(got["loss"], nll[:, start:end].mean(), rtol=1e-5)
  np.testing.assert_allclose(r["loss"], nll.mean(), rtol=1e-5)
  assert r["documents"] == 3 and r["tokens"] == 3 * length
  with pytest.raises(ValueError, match="shorter than length"):
    loss_by_position(lm, docs, 160)


def test_bad_rows_are_refused():
  lm = random_model(tiny({}), seed=0)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    score_rows(lm, np.full((1, 4), lm.vocab_size), np.zeros((1, 4)))
  with pytest.raises(ValueError, match="lengths"):
    score_rows(lm, np.zeros((1, 4)), np.zeros((1, 4)), [5])


def test_bucket_sums_count_only_each_rows_real_positions():
  rng = np.random.default_rng(0)
  nll, lengths, edges = rng.random((3, 10)), np.array([10, 4, 0]), [0, 3, 6, 10]
  sums, counts = bucket_sums(nll, lengths, edges)
  for k, (start, end) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
    real = [nll[b, t] for b in range(3) for t in range(start, end) if t < lengths[b]]
    assert counts[k] == len(real) and sums[k] == pytest.approx(sum(real))
  means = bucket_means(sums, counts, edges)
  assert [m["tokens"] for m in means] == [6, 4, 4] and means[1]["loss"] == pytest.approx(sums[1] / 4)
  assert bucket_means(np.zeros(1), np.zeros(1, int), [0, 5])[0]["loss"] is None
