"""Sampling draws from the renormalised distribution that temperature, top-k and top-p leave, computed
here independently in float64; the reported log-probability is the model's, before any of them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.inference.sampling import Sampling, filtered_logits, sample

DRAWS = 40_000


def _expected(logits, temperature, top_k, top_p):
  """The distribution the draws should follow, float64, by sorting (not by the code under test)."""
  x = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-x, kind="stable")
  keep = np.zeros(x.shape, bool)
  keep[order[:top_k or len(x)]] = True
  if top_p is not None:
    p = np.exp(x - x[keep].max()) * keep
    p /= p.sum()
    mass = 0.0
    kept_p = np.zeros(x.shape, bool)
    for i in order:
      if keep[i] and mass < top_p:
        kept_p[i] = True
        mass += p[i]
    keep = kept_p
  p = np.exp(x - x[keep].max()) * keep
  return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8),
                                                      (0.9, 6, 0.7)])
def test_empirical_frequencies_match_the_renormalised_distribution(temperature, top_k, top_p):
  logits = jnp.asarray(np.random.default_rng(0).normal(0.0, 1.5, 12), jnp.float32)
  want = _expected(logits, temperature, top_k, top_p)
  keys = jax.random.split(jax.random.key(3), DRAWS)
  tokens, logp = jax.jit(lambda k: sample(jnp.broadcast_to(logits, (DRAWS, 12)), k,
                                          Sampling(temperature, top_k, top_p)))(keys)
  counts = np.bincount(np.asarray(tokens), minlength=12)
  assert counts[want == 0].sum() == 0  # nothing outside the kept set
  # Pearson's chi-square over the kept tokens: for k - 1 <= 11 degrees of freedom, 40 is far beyond
  # its 99.99th percentile, while a distribution off by a few percent in one token exceeds it.
  kept = want > 0
  chi2 = float(np.sum((counts[kept] - DRAWS * want[kept]) ** 2 / (DRAWS * want[kept])))
  assert chi2 < 40.0, (chi2, counts, np.round(DRAWS * want))
  reference = np.asarray(jax.nn.log_softmax(logits))
  np.testing.assert_allclose(np.asarray(logp), reference[np.asarray(tokens)], rtol=1e-6, atol=1e-6)


def test_greedy_takes_the_argmax_and_ties_in_the_cuts_are_kept():
  logits = jnp.asarray([[0.0, 3.0, 1.0, 3.0, -2.0]])
  tokens, _ = sample(logits, jax.random.split(jax.random.key(0), 1), Sampling())
  assert int(tokens[0]) == 1
  # top_k=1 keeps both tokens tied at the top; top_p=0.1 keeps the first of the sorted order and its tie.
  for s in (Sampling(1.0, 1, None), Sampling(1.0, None, 0.1)):
    kept = np.isfinite(np.asarray(filtered_logits(logits, s)[0]))
    assert kept.tolist() == [False, True, False, True, False]


def test_arguments_are_checked():
  for bad, match in ((Sampling(-0.5), "temperature"), (Sampling(float("nan")), "temperature"),
                     (Sampling(1.0, 0), "top_k"), (Sampling(1.0, 13), "top_k"),
                     (Sampling(1.0, None, 0.0), "top_p"), (Sampling(1.0, 2.5), "top_k")):
    with pytest.raises(ValueError, match=match):
      bad.checked(12)
  assert Sampling(1, 3, 1).checked(12) == Sampling(1.0, 3, 1.0)
