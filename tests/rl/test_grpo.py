"""grpo_loss and group_advantages against values worked out by hand, and in float64 for random batches;
the loss's gradient with respect to logp; the chunked token log-probabilities against a plain softmax."""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.rl import group_advantages, grpo_loss
from moejax.rl.advantages import informative_groups, overlong_penalty
from moejax.rl.logprobs import token_logprobs


def test_group_advantages_by_hand():
  # Group [1, 0, 0, 1]: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735.
  adv = np.asarray(group_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])))
  s = math.sqrt(1.0 / 3.0)
  a = 0.5 / (s + 1e-6)
  np.testing.assert_allclose(adv[0], [a, -a, -a, a], rtol=1e-6)
  np.testing.assert_array_equal(adv[1], 0.0)  # no spread: no signal
  unscaled = group_advantages(np.array([[3.0, 1.0]]), scale="none")
  np.testing.assert_allclose(np.asarray(unscaled), [[1.0, -1.0]])


def test_group_of_one_sample_has_advantage_zero_and_bad_arguments_are_refused():
  np.testing.assert_array_equal(np.asarray(group_advantages(np.array([[0.7], [3.0]]))), [[0.0], [0.0]])
  with pytest.raises(ValueError, match="scale"):
    group_advantages(np.zeros((2, 2)), scale="mad")
  with pytest.raises(ValueError, match="groups"):
    group_advantages(np.zeros((4,)))


def test_dynamic_sampling_and_overlong_penalty():
  np.testing.assert_array_equal(informative_groups([[1, 1, 1], [0, 1, 0], [0, 0, 0]]), [False, True, False])
  # max_length 100, cache 20: no penalty to 80 tokens, -0.5 at 90, -1 at 100 and beyond.
  np.testing.assert_allclose(overlong_penalty([50, 80, 90, 100, 130], max_length=100, cache=20),
                             [0.0, 0.0, -0.5, -1.0, -1.0])
  with pytest.raises(ValueError):
    overlong_penalty([1], max_length=10, cache=11)


def _loss_by_hand(logp, old, adv, mask, clip_low, clip_high, ref=None, kl_coef=0.0, aggregation="token-mean"):
  """The loss from its definition, float64, one token at a time."""
  per_seq, total, count = [], 0.0, 0
  for b in range(logp.shape[0]):
    seq, n = 0.0, 0
    for t in range(logp.shape[1]):
      if not mask[b, t]:
        continue
      r = math.exp(logp[b, t] - old[b, t])
      loss = max(-adv[b] * r, -adv[b] * min(max(r, 1 - clip_low), 1 + clip_high))
      if ref is not None:
        d = ref[b, t] - logp[b, t]
        loss += kl_coef * (math.exp(d) - d - 1)
      seq, n = seq + loss, n + 1
    total, count = total + seq, count + n
    if n:
      per_seq.append(seq / n)
  if aggregation == "token-mean":
    return total / max(count, 1)
  return sum(per_seq) / max(len(per_seq), 1)


def test_grpo_loss_by_hand_small_batch():
  # Row 0 (A = 1): ratios e^0.5 = 1.6487 (clipped to 1.28: loss -1.28) and e^-0.1 = 0.9048 (-0.9048).
  # Row 1 (A = -2): ratio e^-0.5 = 0.6065, clipped at 0.8: max(1.2131, 1.6) = 1.6; a masked token.
  logp = jnp.array([[-1.0, -2.1, 0.0], [-1.5, -3.0, 0.0]])
  old = jnp.array([[-1.5, -2.0, 0.0], [-1.0, -1.0, 0.0]])
  mask = jnp.array([[1, 1, 0], [1, 0, 0]], jnp.float32)
  adv = jnp.array([1.0, -2.0])
  want_token = (-1.28 - math.exp(-0.1) + 1.6) / 3
  want_seq = ((-1.28 - math.exp(-0.1)) / 2 + 1.6) / 2
  assert float(grpo_loss(logp, old, adv, mask)) == pytest.approx(want_token, rel=1e-6)
  by_sequence = grpo_loss(logp, old, adv, mask, aggregation="sequence-mean")
  assert float(by_sequence) == pytest.approx(want_seq, rel=1e-6)


@hypothesis.settings(deadline=None, max_examples=15)
@hypothesis.given(st.integers(1, 5), st.integers(1, 9), st.sampled_from(["token-mean", "sequence-mean"]),
                  st.booleans(), st.integers(0, 2**31 - 1))
def test_grpo_loss_and_gradient_against_the_definition(B, T, aggregation, with_kl, seed):
  rng = np.random.default_rng(seed)
  logp = -rng.exponential(1.0, (B, T))
  old = logp + rng.normal(0, 0.4, (B, T))
  ref = logp + rng.normal(0, 0.3, (B, T)) if with_kl else None
  adv = rng.normal(0, 1.0, B)
  mask = (rng.random((B, T)) < 0.7).astype(np.float64)
  kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.1 if with_kl else 0.0, aggregation=aggregation)
  f = lambda lp: grpo_loss(lp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32),
                           jnp.asarray(mask, jnp.float32), ref_logp_BT=None if ref is None else
                           jnp.asarray(ref, jnp.float32), **kw)
  value, grad = jax.value_and_grad(f)(jnp.asarray(logp, jnp.float32))
  want = _loss_by_hand(logp, old, adv, mask, 0.2, 0.28, ref, kw["kl_coef"], aggregation)
  assert float(value) == pytest.approx(want, rel=1e-4, abs=1e-5)
  # The gradient by central differences of the float64 definition, token by token.
  eps = 1e-6
  for b in range(B):
    for t in range(T):
      up, down = logp.copy(), logp.copy()
      up[b, t] += eps
      down[b, t] -= eps
      fd = (_loss_by_hand(up, old, adv, mask, 0.2, 0.28, ref, kw["kl_coef"], aggregation)
            - _loss_by_hand(down, old, adv, mask, 0.2, 0.28, ref, kw["kl_coef"], aggregation)) / (2 * eps)
      ratio = math.exp(logp[b, t] - old[b, t])
      if mask[b, t] and min(abs(ratio - 0.8), abs(ratio - 1.28)) < 1e-3:
        continue  # at the clip's kink the derivative is one-sided
      assert float(grad[b, t]) == pytest.approx(fd, rel=2e-3, abs=2e-5), (b, t)
  assert np.all(np.asarray(grad)[mask == 0] == 0)  # masked tokens get no gradient


def test_clipped_tokens_get_no_gradient_and_kl_needs_a_reference():
  logp = jnp.array([[0.0, 0.0]])
  old = jnp.array([[-1.0, 0.1]])  # ratio e (above 1.28, A > 0: clipped) and e^-0.1 (inside)
  grad = jax.grad(lambda lp: grpo_loss(lp, old, jnp.array([1.0]), jnp.ones((1, 2))))(logp)
  assert float(grad[0, 0]) == 0.0 and float(grad[0, 1]) == pytest.approx(-math.exp(-0.1) / 2, rel=1e-6)
  with pytest.raises(ValueError, match="ref_logp"):
    grpo_loss(logp, old, jnp.array([1.0]), jnp.ones((1, 2)), kl_coef=0.1)
  with pytest.raises(ValueError, match="advantages"):
    grpo_loss(logp, old, jnp.array([1.0, 2.0]), jnp.ones((1, 2)))


@pytest.mark.parametrize("T,chunk", [(7, 3), (16, 16), (5, 8)])
def test_chunked_token_logprobs_match_a_plain_softmax(T, chunk):
  rng = np.random.default_rng(T)
  h = jnp.asarray(rng.normal(size=(2, T, 6)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(6, 11)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 11, (2, T)), jnp.int32)

  def plain(h, w):
    logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, w, precision="highest"), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], -jnp.sum(jnp.exp(logp) * logp, -1)

  got, entropy = token_logprobs(h, w, targets, chunk=chunk)
  want, want_entropy = plain(h, w)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-5)
  g_got = jax.grad(lambda h, w: jnp.sum(token_logprobs(h, w, targets, chunk=chunk)[0] ** 2), (0, 1))(h, w)
  g_want = jax.grad(lambda h, w: jnp.sum(plain(h, w)[0] ** 2), (0, 1))(h, w)
  for a, b in zip(g_got, g_want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
