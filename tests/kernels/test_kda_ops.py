"""KDA reference ops: recurrent vs a float64 NumPy loop, chunked vs recurrent (values and gradients),
packed segments vs documents run alone, bf16 stability at the gate bound, input errors, retracing."""

import functools

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from references import doc_lengths, ids_from_lengths

from pallas_kernels.kda import chunk_kda, recurrent_kda

LB = -5.0


def numpy_kda(q, k, v, g, beta, scale, initial_state=None):
  """Float64 loop over time, written in the literal (I - b k k^T) Diag(e^g) S + b k v^T form."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  B, T, H, K = q.shape
  V = v.shape[-1]
  o = np.zeros((B, T, H, V))
  final = np.zeros((B, H, K, V))
  for b in range(B):
    for h in range(H):
      S = np.zeros((K, V)) if initial_state is None else np.asarray(initial_state[b, h], np.float64)
      for t in range(T):
        kt, bt = k[b, t, h], beta[b, t, h]
        decayed = np.diag(np.exp(g[b, t, h])) @ S
        S = (np.eye(K) - bt * np.outer(kt, kt)) @ decayed + bt * np.outer(kt, v[b, t, h])
        o[b, t, h] = scale * S.T @ q[b, t, h]
      final[b, h] = S
  return o, final


def make_inputs(seed, B, T, H, K, V, init=True, dtype=jnp.float32):
  """q, k L2-normalised as the layer makes them; gates uniform in [-5, 0) with ~10% exactly at -5."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(rng.normal(size=(B, T, H, K)))
  k = unit(rng.normal(size=(B, T, H, K)))
  v = rng.normal(size=(B, T, H, V))
  g = rng.uniform(LB, 0.0, size=(B, T, H, K))
  g[rng.uniform(size=g.shape) < 0.1] = LB
  beta = rng.uniform(0.0, 1.0, size=(B, T, H))
  S0 = rng.normal(size=(B, H, K, V)) if init else None
  cast = lambda x: None if x is None else jnp.asarray(x, dtype)
  return tuple(cast(x) for x in (q, k, v, g, beta)), (None if S0 is None else jnp.asarray(S0, jnp.float32))


def assert_close(actual, expected, rtol):
  """Per leaf: |a - e| <= rtol * (|e| + max|e|), so tiny entries are judged against the leaf's scale."""
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    e = np.asarray(e, np.float64)
    chex.assert_trees_all_close(np.asarray(a, np.float64), e, rtol=rtol, atol=rtol * np.max(np.abs(e)))


def _run(impl, C, qkvgb, S0, segment_ids=None, scale=None):
  return chunk_kda(*qkvgb, scale=scale, initial_state=S0, output_final_state=True, segment_ids=segment_ids,
                   chunk_size=C, implementation=impl)


@pytest.mark.parametrize("T,H,K,V,init,scale", [(1, 1, 4, 3, True, None), (23, 2, 8, 5, False, None),
                                                 (40, 1, 6, 10, True, 0.3)])
def test_recurrent_matches_float64_loop(T, H, K, V, init, scale):
  qkvgb, S0 = make_inputs(0, 2, T, H, K, V, init)
  o, S = recurrent_kda(*qkvgb, scale=scale, initial_state=S0, output_final_state=True)
  o_ref, S_ref = numpy_kda(*qkvgb, K**-0.5 if scale is None else scale, S0)
  assert o.dtype == jnp.float32 and S.dtype == jnp.float32
  assert_close((o, S), (o_ref, S_ref), rtol=1e-5)
  o_only, S_none = recurrent_kda(*qkvgb, scale=scale, initial_state=S0)
  assert S_none is None
  np.testing.assert_array_equal(o_only, o)


@functools.partial(jax.jit, static_argnames=("impl", "C"))
def _fwd_and_vjp(qkvgb, S0, cotangents, impl, C):
  f = lambda qkvgb, S0: _run(impl, C, qkvgb, S0)
  outputs, vjp = jax.vjp(f, qkvgb, S0)
  return outputs, vjp(cotangents)


# Odd lengths, every chunk size, K != V, both head counts, initial state on and off. Each case costs
# two CPU compilations of a forward+backward, so the grid is chosen to cover, not to multiply.
@pytest.mark.parametrize("T,C,H,K,V,init", [(1, 16, 1, 8, 4, True), (17, 16, 2, 8, 12, False),
                                            (50, 32, 1, 16, 8, True), (131, 64, 2, 8, 4, False)])
def test_chunked_matches_recurrent_values_and_grads(T, C, H, K, V, init):
  B = 2
  qkvgb, S0 = make_inputs(T * 7 + C, B, T, H, K, V, init)
  if S0 is None:  # still differentiate w.r.t. the initial state, from zero
    S0 = jnp.zeros((B, H, K, V), jnp.float32)
  rng = np.random.default_rng(1)
  cot = (jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32),
         jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32))
  out_rec, grads_rec = _fwd_and_vjp(qkvgb, S0, cot, "recurrent", C)
  out_xla, grads_xla = _fwd_and_vjp(qkvgb, S0, cot, "xla", C)
  assert_close(out_xla, out_rec, rtol=1e-4)
  assert_close(grads_xla, grads_rec, rtol=1e-4)
  for grad in jax.tree.leaves(grads_xla):
    assert np.all(np.isfinite(grad)) and np.any(grad != 0)


def test_default_implementation_is_the_chunked_form():
  qkvgb, S0 = make_inputs(3, 1, 20, 1, 4, 4)
  o, _ = chunk_kda(*qkvgb, chunk_size=16)
  o_xla, _ = chunk_kda(*qkvgb, chunk_size=16, implementation="xla")
  np.testing.assert_array_equal(o, o_xla)


def _check_packed_equals_alone(layouts, C, seed=0):
  """Each row of the batch packs documents of the given lengths; compare against each run alone."""
  T = sum(layouts[0])
  B, H, K, V = len(layouts), 2, 8, 6
  qkvgb, S0 = make_inputs(seed, B, T, H, K, V)
  seg = jnp.asarray(np.stack([ids_from_lengths(lengths) for lengths in layouts]), jnp.int32)
  o_ref, S_ref = np.zeros((B, T, H, V)), np.zeros((B, H, K, V))
  for b, lengths in enumerate(layouts):
    start = 0
    for i, n in enumerate(lengths):
      doc = tuple(np.asarray(x[b:b + 1, start:start + n]) for x in qkvgb)
      init = np.asarray(S0[b:b + 1]) if i == 0 else None  # initial state belongs to the first document
      o_doc, S_ref[b:b + 1] = numpy_kda(*doc, K**-0.5, init)
      o_ref[b, start:start + n] = o_doc[0]
      start += n
  for impl in ("xla", "recurrent"):
    out = _run(impl, C, qkvgb, S0, segment_ids=seg)
    assert_close(out, (o_ref, S_ref), rtol=1e-4)


# Row 0: starts mid-tile (5, 6, 18, 33, 34, 54), on a chunk boundary (32), documents of length 1.
# Row 1: two halves, and the ids alternate so document 3 reuses document 1's id.
LAYOUTS = ([5, 1, 12, 14, 1, 1, 20, 26], [40, 40])


@pytest.mark.parametrize("C", [16, 32])
def test_packed_segments_equal_documents_alone(C):
  _check_packed_equals_alone(LAYOUTS, C)


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=12), st.lists(st.integers(1, 30), max_size=12),
       st.integers(0, 2**16))
def test_packed_segments_random_layouts(lengths0, lengths1, seed):
  T = 64
  _check_packed_equals_alone((doc_lengths(lengths0, T), doc_lengths(lengths1, T)), 32, seed)


def test_no_gradient_crosses_a_document_boundary():
  B, T, H, K, V, start = 1, 48, 1, 4, 4, 21
  qkvgb, S0 = make_inputs(5, B, T, H, K, V)
  seg = jnp.asarray(np.arange(T)[None] >= start, jnp.int32)
  for impl in ("xla", "recurrent"):
    def last_doc_loss(qkvgb, S0, impl=impl):
      o, S = _run(impl, 16, qkvgb, S0, segment_ids=seg)
      return jnp.sum(o[:, start:] ** 2) + jnp.sum(S**2)
    grads, grad_S0 = jax.grad(last_doc_loss, argnums=(0, 1))(qkvgb, S0)
    np.testing.assert_array_equal(grad_S0, 0.0)
    for grad in grads:
      np.testing.assert_array_equal(grad[:, :start], 0.0)
      assert np.any(grad[:, start:] != 0)


def test_bf16_at_the_gate_bound_stays_finite():
  B, T, H, K, V = 1, 4096, 2, 16, 16
  (q, k, v, _, beta), _ = make_inputs(2, B, T, H, K, V, init=False, dtype=jnp.bfloat16)
  g = jnp.full((B, T, H, K), LB, jnp.bfloat16)
  o, S = chunk_kda(q, k, v, g, beta, output_final_state=True)
  assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(o, np.float32))) and np.all(np.isfinite(S))
  # With e^-5 decay per step the state holds only a few recent tokens: |o| stays of the order of |v|.
  assert float(jnp.max(jnp.abs(o))) <= 2 * float(jnp.max(jnp.abs(v)))
  o_rec, S_rec = chunk_kda(q, k, v, g, beta, output_final_state=True, implementation="recurrent")
  assert_close((o.astype(jnp.float32), S), (o_rec.astype(jnp.float32), S_rec), rtol=1e-2)
  grads = jax.grad(lambda q, k, v, g, beta: jnp.sum(chunk_kda(q, k, v, g, beta)[0].astype(jnp.float32)),
                   argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
  for grad in grads:
    assert np.all(np.isfinite(np.asarray(grad, np.float32)))


def test_bad_inputs_raise_clear_errors():
  (q, k, v, g, beta), S0 = make_inputs(0, 1, 8, 1, 4, 3)
  cases = [
      (dict(q=q[0]), "q must have rank 4"),
      (dict(beta=beta[..., None]), "beta must have rank 3"),
      (dict(k=k[:, :, :, :3]), "k shape"),
      (dict(g=g[:, :4]), "g shape"),
      (dict(v=v[:, :4]), "v shape"),
      (dict(beta=beta[:, :4]), "beta shape"),
      (dict(initial_state=S0[..., :2]), "initial_state shape"),
      (dict(segment_ids=jnp.zeros((1, 7), jnp.int32)), "segment_ids shape"),
      (dict(segment_ids=jnp.zeros((1, 8), jnp.float32)), "segment_ids must be an integer"),
      (dict(q=q.astype(jnp.int32)), "q must be floating point"),
      (dict(implementation="cuda"), "unknown KDA implementation"),
      (dict(chunk_size=24), "chunk_size must be a positive multiple of 16"),
      (dict(chunk_size=0), "chunk_size must be a positive multiple of 16"),
      (dict(scale=jnp.ones(4)), "scale must be a scalar"),
  ]
  base = dict(q=q, k=k, v=v, g=g, beta=beta)
  for override, message in cases:
    kwargs = {**base, **override}
    args = [kwargs.pop(name) for name in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match=message):
      chunk_kda(*args, **kwargs)
  with pytest.raises(ValueError, match="k shape"):
    recurrent_kda(q, k[:, :4], v, g, beta)
  if jax.default_backend() != "gpu":  # the kernel itself is tested in interpret mode (test_kda_pallas)
    with pytest.raises(ValueError, match="needs a GPU"):
      chunk_kda(q, k, v, g, beta, implementation="pallas")


def test_jitted_chunked_op_traces_once_per_shape():
  def op(q, k, v, g, beta, initial_state):
    return chunk_kda(q, k, v, g, beta, initial_state=initial_state, chunk_size=16, output_final_state=True)

  traced = jax.jit(chex.assert_max_traces(op, n=1))
  for seed in range(3):
    qkvgb, S0 = make_inputs(seed, 1, 20, 1, 4, 4)
    traced(*qkvgb, initial_state=S0)
  # The counter is live: a new shape must retrace and trip it.
  qkvgb, S0 = make_inputs(0, 1, 21, 1, 4, 4)
  with pytest.raises(AssertionError):
    traced(*qkvgb, initial_state=S0)
