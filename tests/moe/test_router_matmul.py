"""The router's logits on bf16 tensor cores (moejax.moe.router.logits_bf16x3) against float64 and
against the float32 matmul at HIGHEST that it replaces: forward, dx and dW, over random shapes and
weights of wide dynamic range."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moejax.moe.router import _bf16_parts, logits_bf16x3, router_scores


def inputs(seed, M, D, E):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(M, D)), jnp.bfloat16)
  # Weights over eight decades, so that every one of the three bf16 parts matters.
  w = jnp.asarray(rng.normal(size=(D, E)) * 10.0 ** rng.uniform(-6, 2, size=(D, E)), jnp.float32)
  dl = jnp.asarray(rng.normal(size=(M, E)) * 10.0 ** rng.uniform(-4, 1, size=(M, E)), jnp.float32)
  return x, w, dl


def f32_highest(x, w):
  return jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@settings(max_examples=6, deadline=None)
@given(M=st.integers(1, 96), D=st.integers(1, 160), E=st.integers(1, 72), seed=st.integers(0, 2**16))
@example(M=15, D=1, E=1, seed=0)  # one element dominates dx, and the two roundings of it differ by an ulp
def test_matches_float64_and_the_highest_precision_matmul(M, D, E, seed):
  x, w, dl = inputs(seed, M, D, E)
  x64, w64, dl64 = (np.asarray(a, np.float64) for a in (x, w, dl))
  got, vjp = jax.vjp(logits_bf16x3, x, w)
  dx, dw = vjp(dl)
  want, vjp_f32 = jax.vjp(f32_highest, x, w)
  dx_f32, dw_f32 = vjp_f32(dl)
  assert got.dtype == jnp.float32 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  # Float32 sums of exact products: within float32 rounding of float64, like HIGHEST.
  tol = 4 * D * np.finfo(np.float32).eps
  assert rel(got, x64 @ w64) <= tol and rel(want, x64 @ w64) <= tol
  assert rel(dw, x64.T @ dl64) <= 4 * M * np.finfo(np.float32).eps
  # dx is rounded to bf16 like the float32 path's (half an ulp, at most 2^-8 of each element); its
  # two-part product adds far less than that. Two such roundings of nearly equal values can land an ulp
  # apart (up to 2^-7 of an element), which decides the norm where one element dominates it.
  dx64 = dl64 @ w64.T
  assert rel(dx, dx64) <= 2.0**-8 and rel(dx, dx_f32) <= 2.0**-7
  np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_f32, np.float32), rtol=2.0**-7,
                             atol=float(np.abs(dx64).max()) * 2.0**-14)


def test_router_scores_choose_the_same_experts():
  """At a router's scale (unit activations, weights ~ N(0, 1/D)) the scores agree to float32 rounding
  of the logits, and so does the top-k."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(256, 128)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(128, 64)) / np.sqrt(128), jnp.float32)
  s_f32, s_split = router_scores(x, w, "f32"), router_scores(x, w, "bf16x3")
  np.testing.assert_allclose(np.asarray(s_split), np.asarray(s_f32), rtol=1e-6, atol=1e-7)
  assert np.array_equal(np.asarray(jax.lax.top_k(s_split, 8)[1]), np.asarray(jax.lax.top_k(s_f32, 8)[1]))


def test_auto_picks_bf16x3_for_bf16_activations_only():
  x, w, _ = inputs(0, 16, 32, 4)
  for x_ in (x.astype(jnp.bfloat16), x.astype(jnp.float32)):
    want = router_scores(x_, w, "bf16x3" if x_.dtype == jnp.bfloat16 else "f32")
    np.testing.assert_array_equal(np.asarray(router_scores(x_, w, "auto")), np.asarray(want))
  # The two modes differ on these inputs, so the comparison above tells them apart.
  split, single = (np.asarray(router_scores(x.astype(jnp.bfloat16), w, m)) for m in ("bf16x3", "f32"))
  assert not np.array_equal(split, single)


def test_rejects_what_it_cannot_split():
  x, w, _ = inputs(0, 4, 8, 2)
  with pytest.raises(ValueError, match="bf16 activations"):
    logits_bf16x3(x.astype(jnp.float32), w)
  with pytest.raises(ValueError, match="router matmul 'tf32' not in"):
    router_scores(x, w, "tf32")


def test_split_is_exact_under_jit():
  """Three bf16 parts sum to float32 W exactly, jitted too (the parts are rounded by reduce_precision,
  which XLA keeps, where it may drop a float32 -> bf16 -> float32 round trip: on the GPU it does),
  across the magnitudes the docstring promises; the later parts are not all zero."""
  rng = np.random.default_rng(11)
  w = jnp.asarray(rng.normal(size=4096) * 10.0 ** rng.uniform(-30, 30, size=4096), jnp.float32)
  for split in (lambda w: _bf16_parts(w, 3), jax.jit(lambda w: _bf16_parts(w, 3))):
    parts = [np.asarray(p, np.float64) for p in split(w)]
    np.testing.assert_array_equal(parts[0] + parts[1] + parts[2], np.asarray(w, np.float64))
    assert np.count_nonzero(parts[1]) > 0.9 * w.size and np.count_nonzero(parts[2]) > 0.5 * w.size
