"""SiTU-GLU bounds and the chunked cross-entropy against a direct float64 computation."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.layers.ffn import SiTUGLU, situ_glu
from moejax.training.loss import cross_entropy, logsumexp_one_pass

finite_floats = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(gate=finite_floats, up=finite_floats)
def test_situ_glu_is_bounded_by_b1_b2(gate, up):
  h = float(situ_glu(jnp.float32(gate), jnp.float32(up), 4.0, 25.0))
  assert np.isfinite(h) and abs(h) <= 100.0


def test_situ_glu_bound_is_approached_and_holds_in_bf16():
  h = situ_glu(jnp.array([1e4], jnp.float32), jnp.array([1e4], jnp.float32))
  np.testing.assert_allclose(np.asarray(h), [100.0], rtol=1e-6)
  hb = situ_glu(jnp.array([60000.0], jnp.bfloat16), jnp.array([-60000.0], jnp.bfloat16))
  assert hb.dtype == jnp.bfloat16 and abs(float(hb[0])) <= 100.0


def test_situ_glu_is_swiglu_near_zero():
  x = jnp.linspace(-0.05, 0.05, 11)
  u = jnp.linspace(0.04, -0.04, 11)
  swiglu = x * jax.nn.sigmoid(x) * u
  np.testing.assert_allclose(np.asarray(situ_glu(x, u)), np.asarray(swiglu), rtol=1e-3, atol=1e-8)


@pytest.mark.parametrize("b1,b2", [(4.0, 25.0), (1.5, 3.0)])
def test_situ_glu_forward_is_accurate_per_element(b1, b2):
  """The forward pass's exponential form, element by element against float64, in float32 over
  magnitudes from 1e-6 to 1e3 of either sign: tiny inputs (where 1 - exp(-z) cancels), gates deep in
  the sigmoid's tail (where exp(-|g|) is tiny) and saturated tanh all included."""
  rng = np.random.default_rng(3)
  g, u = ((rng.standard_normal(20_000) * 10.0 ** rng.uniform(-6, 3, 20_000)).astype(np.float32)
          for _ in range(2))
  want = _reference_vjp(g, u, np.ones_like(g), b1, b2)[0]
  got = np.asarray(situ_glu(jnp.asarray(g), jnp.asarray(u), b1, b2), np.float64)
  normal = np.abs(want) > 1e-30  # below that float32 flushes or loses digits in the product itself
  np.testing.assert_allclose(got[normal], want[normal], rtol=2e-6, atol=0)
  np.testing.assert_array_equal(np.signbit(got[normal]), np.signbit(want[normal]))


def test_situ_glu_limits_and_nan():
  """Infinite inputs give the bounded limits, NaN stays NaN (no silent clamping)."""
  g = jnp.array([jnp.inf, -jnp.inf, 2.0, 2.0, jnp.nan, 0.0], jnp.float32)
  u = jnp.array([2.0, 2.0, jnp.inf, -jnp.inf, 1.0, jnp.nan], jnp.float32)
  h = np.asarray(situ_glu(g, u, 4.0, 25.0))
  a2, b2 = 4 * np.tanh(0.5) / (1 + np.exp(-2.0)), 25 * np.tanh(2 / 25)
  np.testing.assert_allclose(h[:4], [4 * b2, 0.0, 25 * a2, -25 * a2], rtol=1e-6)
  assert np.isnan(h[4]) and np.isnan(h[5])


def _situ_autodiff(gate, up, b1, b2):
  """The formula differentiated by JAX (the reference for the hand-written backward pass)."""
  return (b1 * jnp.tanh(gate / b1) * jax.nn.sigmoid(gate)) * (b2 * jnp.tanh(up / b2))


def _reference_vjp(gate, up, dh, b1, b2):
  """(h, dgate, dup) by autodiff of the formula in float64, returned as float64 NumPy."""
  with jax.enable_x64(True):
    x64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (gate, up, dh)]
    h, vjp = jax.vjp(lambda g, u: _situ_autodiff(g, u, b1, b2), *x64[:2])
    return [np.asarray(x) for x in (h, *vjp(x64[2]))]


def _assert_close(got, want, rtol):
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=rtol, atol=rtol * np.abs(b).max())


@pytest.mark.parametrize("b1,b2", [(4.0, 25.0), (1.5, 3.0)])
def test_situ_glu_gradients_match_autodiff(b1, b2):
  """Forward and both gradients of situ_glu against float64 autodiff of the formula, over magnitudes
  from 1e-3 to 1e3 (saturated tanh and sigmoid included), in float32 and in bf16 (within bf16
  rounding; there the reference sees the rounded inputs)."""
  ks = jax.random.split(jax.random.key(0), 3)
  scale = 10.0 ** jax.random.uniform(ks[2], (64, 48), minval=-3, maxval=3)
  gate, up = (jax.random.normal(k, (64, 48)) * scale for k in ks[:2])
  dh = jax.random.normal(jax.random.key(1), (64, 48))
  want = _reference_vjp(gate, up, dh, b1, b2)
  h, vjp = jax.vjp(lambda g, u: situ_glu(g, u, b1, b2), gate, up)
  _assert_close((h, *vjp(dh)), want, 1e-5)
  bf = lambda x: x.astype(jnp.bfloat16)
  h16, vjp16 = jax.vjp(lambda g, u: situ_glu(g, u, b1, b2), bf(gate), bf(up))
  got16 = (h16, *vjp16(bf(dh)))
  assert all(x.dtype == jnp.bfloat16 for x in got16)
  _assert_close(got16, _reference_vjp(bf(gate), bf(up), bf(dh), b1, b2), 1e-2)


def test_dense_situ_glu_matches_numpy():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 5, 8)).astype(np.float32) * 3
  module = SiTUGLU(hidden_dim=16)
  params = jax.tree.map(lambda p: p.unbox() if hasattr(p, "unbox") else p,
                        module.init(jax.random.key(0), x), is_leaf=lambda p: hasattr(p, "unbox"))
  w = {k: np.asarray(v["kernel"], np.float64) for k, v in params["params"].items()}
  g, u = x @ w["gate"], x @ w["up"]
  sig = 1 / (1 + np.exp(-g))
  ref = ((4 * np.tanh(g / 4) * sig) * (25 * np.tanh(u / 25))) @ w["down"]
  np.testing.assert_allclose(np.asarray(module.apply(params, x)), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [5, 10, 20])
def test_dense_situ_glu_in_token_chunks_equals_one_pass(chunk):
  """token_chunk: same params, same output and gradients (x and every kernel), bf16 and float32;
  boxed or plain params alike. 20 = all 2x10 tokens at once, so it takes the one-pass path."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(2, 10, 8)), jnp.float32)
  r = jnp.asarray(rng.normal(size=(2, 10, 8)), jnp.float32)
  for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)):
    whole = SiTUGLU(hidden_dim=16, dtype=dtype)
    pieces = SiTUGLU(hidden_dim=16, dtype=dtype, token_chunk=chunk)
    boxed = whole.init(jax.random.key(0), x)
    chex.assert_trees_all_equal_structs(boxed, pieces.init(jax.random.key(0), x))
    params = nn.unbox(boxed)

    def value_and_grads(module, p):
      loss = lambda p, x: jnp.sum(module.apply(p, x).astype(jnp.float32) * r)
      return jax.jit(jax.value_and_grad(loss, (0, 1)))(p, x)

    want = value_and_grads(whole, params)
    chex.assert_trees_all_close(value_and_grads(pieces, params), want, rtol=tol, atol=tol)
    chex.assert_trees_all_close(value_and_grads(pieces, boxed)[0], want[0], rtol=tol, atol=tol)
  with pytest.raises(ValueError, match="token_chunk=3 does not divide the 20 tokens"):
    SiTUGLU(hidden_dim=16, token_chunk=3).apply(params, x)


def _reference_ce(h, w, targets, mask, z_weight):
  logits = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
  lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
  nll = lse - np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
  count = max(mask.sum(), 1.0)
  return float((nll * mask).sum() / count + z_weight * (lse**2 * mask).sum() / count)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 5), width=st.integers(1, 700), scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
       shift=st.sampled_from([0.0, -1e4, 80.0]), seed=st.integers(0, 2**31 - 1))
def test_one_pass_logsumexp_matches_float64(rows, width, scale, shift, seed):
  """Widths past one reduction tile and odd ones, spreads from flat to one dominant entry, and shifts
  whose exponentials would under- or overflow unshifted."""
  x = (np.random.default_rng(seed).standard_normal((rows, width)) * scale + shift).astype(np.float32)
  got = np.asarray(jax.jit(logsumexp_one_pass)(jnp.asarray(x)))
  x64 = x.astype(np.float64)
  top = x64.max(-1)
  want = top + np.log(np.sum(np.exp(x64 - top[:, None]), -1))
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * (1 + np.log(width)))


def test_one_pass_logsumexp_of_infinities_and_nan():
  x = jnp.asarray([[0.0, -jnp.inf, 1.0], [jnp.inf, 0.0, 1.0], [jnp.nan, 0.0, 1.0]], jnp.float32)
  got = np.asarray(logsumexp_one_pass(x))
  np.testing.assert_allclose(got[0], np.logaddexp(0.0, 1.0), rtol=1e-6)
  assert np.isnan(got[1]) or got[1] == np.inf  # as jax.nn.logsumexp: no finite answer
  assert np.isnan(got[2])


@settings(max_examples=4, deadline=None)
@given(T=st.integers(1, 40), chunk=st.sampled_from([4, 16, 64]), z_weight=st.sampled_from([0.0, 1e-2]),
       seed=st.integers(0, 1000))
def test_chunked_cross_entropy_matches_direct(T, chunk, z_weight, seed):
  rng = np.random.default_rng(seed)
  B, D, V = 2, 8, 13
  h = rng.normal(size=(B, T, D)).astype(np.float32)
  w = rng.normal(size=(D, V)).astype(np.float32)
  targets = rng.integers(0, V, size=(B, T))
  mask = (rng.random((B, T)) > 0.3).astype(np.float32)
  loss, metrics = cross_entropy(jnp.asarray(h), jnp.asarray(w), jnp.asarray(targets), jnp.asarray(mask),
                                z_loss_weight=z_weight, chunk=chunk)
  np.testing.assert_allclose(float(loss), _reference_ce(h, w, targets, mask, z_weight), rtol=1e-5, atol=1e-6)
  assert float(metrics["tokens"]) == mask.sum()

  # Gradients match those of the unchunked formula.
  def direct(h, w):
    logits = h @ w
    lse = jax.nn.logsumexp(logits, -1)
    nll = lse - jnp.take_along_axis(logits, jnp.asarray(targets)[..., None], -1)[..., 0]
    count = jnp.maximum(mask.sum(), 1.0)
    return (nll * mask).sum() / count + z_weight * (lse**2 * mask).sum() / count

  chunked = lambda h, w: cross_entropy(h, w, jnp.asarray(targets), jnp.asarray(mask),
                                       z_loss_weight=z_weight, chunk=chunk)[0]
  for a, b in zip(jax.grad(chunked, (0, 1))(h, w), jax.grad(direct, (0, 1))(h, w), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("z_weight", [0.0, 1e-2])
def test_cross_entropy_gradients_in_bfloat16(z_weight):
  """bf16 hidden states, float32 head (as the model trains): the gradients made in the forward pass
  agree with float32 autodiff of the unchunked formula on the same (bf16-rounded) inputs."""
  rng = np.random.default_rng(3)
  B, T, D, V = 2, 37, 16, 50
  h = jnp.asarray(rng.normal(size=(B, T, D)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(D, V)) * 0.3, jnp.float32)
  targets = jnp.asarray(rng.integers(0, V, size=(B, T)))
  mask = jnp.asarray(rng.random((B, T)) > 0.2, jnp.float32)

  def direct(h, w):
    logits = h.astype(jnp.float32) @ w.astype(jnp.bfloat16).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, -1)
    nll = lse - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    count = jnp.maximum(mask.sum(), 1.0)
    return (nll * mask).sum() / count + z_weight * (lse**2 * mask).sum() / count

  fused = jax.jit(jax.value_and_grad(
      lambda h, w: cross_entropy(h, w, targets, mask, z_loss_weight=z_weight, chunk=16)[0], (0, 1)))
  (loss, (dh, dw)) = fused(h, w)
  (ref, (dh_ref, dw_ref)) = jax.value_and_grad(direct, (0, 1))(h.astype(jnp.float32), w)
  assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
  for got, want in ((dh, dh_ref), (dw, dw_ref)):
    got, want = np.asarray(got, np.float32), np.asarray(want)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


def test_cross_entropy_metrics_carry_no_gradient_and_bad_shapes_fail():
  h, w = jnp.ones((1, 4, 3)), jnp.ones((3, 5))
  t = jnp.zeros((1, 4), jnp.int32)
  g = jax.grad(lambda h: cross_entropy(h, w, t)[1]["nll"])(h)
  assert not np.any(np.asarray(g))
  with pytest.raises(ValueError, match="head matrix"):
    cross_entropy(h, jnp.ones((4, 5)), t)
  with pytest.raises(ValueError, match="targets shape"):
    cross_entropy(h, w, t[:, :3])
