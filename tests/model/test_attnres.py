"""Block Attention Residuals against an independent NumPy reference of the definition (docs/design.md §4)."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moejax.layers.attnres import AttnResQuery, ResidualState


def _mix_np(sources, w, eps=1e-6):
  v = np.stack(sources).astype(np.float64)
  keys = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
  logits = np.einsum("nbtd,d->nbt", keys, w)
  a = np.exp(logits - logits.max(0))
  a /= a.sum(0)
  return np.einsum("nbt,nbtd->btd", a, v)


def _reference_stack(x0, weights, queries, block_size):
  """Sources by the definition: embedding, each completed block's sum, the current partial sum."""
  completed, current = [x0], []
  for w_sub, q in zip(weights, queries, strict=True):
    sources = completed + ([np.sum(current, axis=0)] if current else [])
    out = np.tanh(_mix_np(sources, q) @ w_sub)
    current.append(out)
    if len(current) == block_size:
      completed.append(np.sum(current, axis=0))
      current = []
  return completed + ([np.sum(current, axis=0)] if current else [])


def _stack_with_module(x0, weights, queries, block_size):
  state = ResidualState.start(jnp.asarray(x0, jnp.float32))
  module = AttnResQuery()
  for w_sub, q in zip(weights, queries, strict=True):
    h = module.apply({"params": {"query": jnp.asarray(q, jnp.float32)}}, state.sources())
    state = state.add(jnp.tanh(h @ jnp.asarray(w_sub, jnp.float32)), block_size)
  return state.sources()


@settings(max_examples=12, deadline=None)
@given(num_sublayers=st.integers(1, 9), block_size=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_block_sources_match_definition(num_sublayers, block_size, seed):
  rng = np.random.default_rng(seed)
  B, T, D = 2, 3, 8
  x0 = rng.normal(size=(B, T, D))
  weights = [rng.normal(size=(D, D)) / np.sqrt(D) for _ in range(num_sublayers)]
  queries = [rng.normal(size=(D,)) for _ in range(num_sublayers)]
  ours = _stack_with_module(x0, weights, queries, block_size)
  ref = _reference_stack(x0, weights, queries, block_size)
  assert len(ours) == len(ref)
  for a, b in zip(ours, ref, strict=True):
    np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=2e-5)


def test_block_size_one_is_full_attnres():
  """Full AttnRes: every sublayer output is its own source."""
  rng = np.random.default_rng(0)
  B, T, D, n = 1, 4, 8, 6
  x0 = rng.normal(size=(B, T, D))
  weights = [rng.normal(size=(D, D)) / np.sqrt(D) for _ in range(n)]
  queries = [rng.normal(size=(D,)) for _ in range(n)]
  outputs = [x0]
  for w_sub, q in zip(weights, queries, strict=True):
    outputs.append(np.tanh(_mix_np(outputs, q) @ w_sub))
  ours = _stack_with_module(x0, weights, queries, block_size=1)
  assert len(ours) == n + 1
  for a, b in zip(ours, outputs, strict=True):
    np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=2e-5)


def test_zero_query_is_uniform_average():
  sources = [jax.random.normal(jax.random.key(i), (2, 5, 16)) * (i + 1) for i in range(4)]
  module = AttnResQuery()
  params = nn.unbox(module.init(jax.random.key(0), sources))
  chex.assert_trees_all_close(params["params"]["query"], jnp.zeros(16))
  h = module.apply(params, sources)
  chex.assert_trees_all_close(h, sum(sources) / 4, rtol=1e-6, atol=1e-6)


def test_keys_are_normalised_values_are_not():
  """Scaling a source scales its value in the mix but not its attention weight."""
  rng = np.random.default_rng(1)
  sources = [rng.normal(size=(1, 2, 8)) for _ in range(3)]
  q = rng.normal(size=(8,))
  scaled = [sources[0] * 10.0] + sources[1:]
  module = AttnResQuery()
  mix = lambda srcs: np.asarray(module.apply({"params": {"query": jnp.asarray(q, jnp.float32)}},
                                             [jnp.asarray(s, jnp.float32) for s in srcs]), np.float64)
  np.testing.assert_allclose(mix(scaled) - mix(sources),
                             _weights_np(sources, q)[0][..., None] * (scaled[0] - sources[0]),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(mix(scaled), _mix_np(scaled, q), rtol=1e-5, atol=1e-5)


def _weights_np(sources, w, eps=1e-6):
  v = np.stack(sources)
  keys = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
  logits = np.einsum("nbtd,d->nbt", keys, w)
  a = np.exp(logits - logits.max(0))
  return a / a.sum(0)


def test_gradient_reaches_query_and_sources():
  sources = [jax.random.normal(jax.random.key(i), (1, 3, 8)) for i in range(3)]
  module = AttnResQuery()
  params = nn.unbox(module.init(jax.random.key(0), sources))
  params["params"]["query"] = jnp.ones(8)  # away from zero, where the softmax gradient vanishes
  g_params, g_src = jax.grad(lambda p, s: jnp.sum(module.apply(p, s) ** 3), argnums=(0, 1))(params, sources)
  assert float(jnp.abs(g_params["params"]["query"]).sum()) > 0
  assert all(float(jnp.abs(g).sum()) > 0 for g in g_src)


def test_empty_sources_rejected():
  with pytest.raises(ValueError, match="at least one source"):
    AttnResQuery().init(jax.random.key(0), [])


def _mix_autodiff(w, sources, stacked, valid, eps=1e-6):
  """The mixture as plain JAX for autodiff to differentiate: no custom VJP, float32 throughout."""
  vs = ([] if stacked is None else [stacked[i] for i in range(stacked.shape[0])]) + list(sources)
  v = jnp.stack([x.astype(jnp.float32) for x in vs])
  keys = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
  logits = jnp.einsum("sbtd,d->sbt", keys, w, precision="highest")
  if stacked is not None:
    mask = jnp.concatenate([valid, jnp.ones((len(sources),), bool)])
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
  return jnp.einsum("sbt,sbtd->btd", jax.nn.softmax(logits, axis=0), v, precision="highest")


@settings(max_examples=4, deadline=None)
@given(num_sources=st.integers(0, 4), num_slots=st.integers(0, 4), seed=st.integers(0, 2**31 - 1),
       data=st.data())
@example(num_sources=0, num_slots=3, seed=1, data=[False, True, False])      # stacked slots only
@example(num_sources=2, num_slots=2, seed=2, data=[False, False])            # every slot masked off
@example(num_sources=3, num_slots=0, seed=3, data=[])                        # list sources only
@example(num_sources=4, num_slots=1, seed=654118, data=[True])                # w's gradient: float32 order
def test_mix_gradients_match_autodiff(num_sources, num_slots, seed, data):
  """attnres_mix's own backward pass against autodiff of the formula: the query, every source and the
  stacked slots (some masked off), with sources of very different scales."""
  from moejax.layers.attnres import attnres_mix

  if num_sources + num_slots == 0:
    num_sources = 1
  drawn = data if isinstance(data, list) else data.draw(st.lists(st.booleans(), min_size=num_slots,
                                                                 max_size=num_slots))
  valid = np.asarray(drawn, bool)
  if num_slots and not valid.any() and num_sources == 0:
    valid[0] = True
  rng = np.random.default_rng(seed)
  B, T, D = 2, 3, 16
  scale = lambda: 10.0 ** rng.uniform(-1, 1)
  sources = tuple(jnp.asarray(scale() * rng.normal(size=(B, T, D)), jnp.float32) for _ in range(num_sources))
  stacked = (jnp.asarray(scale() * rng.normal(size=(num_slots, B, T, D)), jnp.float32) if num_slots
             else None)
  valid_N = jnp.asarray(valid) if num_slots else None
  w = jnp.asarray(rng.normal(size=(D,)), jnp.float32)
  dh = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)

  def value_and_grads(f):
    h, vjp = jax.vjp(lambda w, s, st_: f(w, s, st_, valid_N), w, sources, stacked)
    return h, vjp(dh)

  got = value_and_grads(lambda *a: attnres_mix(*a, 1e-6))
  want = value_and_grads(_mix_autodiff)
  # Each leaf to 2e-5 of its own scale: w's gradient sums terms of the sources' scales (up to 10) in
  # another order, so a small entry among large ones carries their float32 rounding (seed 654118: 5e-5
  # on -0.554 where the leaf reaches 10).
  for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    atol = 2e-5 * max(1.0, float(np.max(np.abs(np.asarray(x)), initial=0.0)))
    chex.assert_trees_all_close(g, x, rtol=2e-5, atol=atol)
  if num_slots:  # masked slots take no part, so they get exact zeros
    assert not np.any(np.asarray(got[1][2])[~valid])


def test_mix_keeps_no_float32_copy_of_a_source():
  """With bf16 sources the backward pass's residuals hold the sources as given and per-row scalars,
  while autodiff of the same formula keeps float32 [B, T, D] copies (which is what this guards)."""
  from moejax.layers.attnres import attnres_mix

  B, T, D = 2, 8, 32
  sources = tuple(jax.random.normal(jax.random.key(i), (B, T, D), jnp.bfloat16) for i in range(3))
  w = jnp.ones((D,), jnp.float32)

  def big_float32_residuals(f):
    _, vjp = jax.vjp(f, w, sources)
    return [x.shape for x in jax.tree.leaves(vjp) if x.dtype == jnp.float32 and x.shape[-1] == D
            and x.size >= B * T * D]

  assert big_float32_residuals(lambda w, s: attnres_mix(w, s, None, None, 1e-6)) == []
  assert big_float32_residuals(lambda w, s: _mix_autodiff(w, s, None, None))


def test_mix_bfloat16_gradients_match_autodiff():
  """bf16 sources (a bf16 model's case): the same bf16 inputs through attnres_mix and through autodiff
  of the float32 formula agree to bf16 rounding, with the output, its cotangent and the source
  gradients in bf16."""
  from moejax.layers.attnres import attnres_mix

  rng = np.random.default_rng(11)
  B, T, D = 2, 5, 32
  bf = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
  sources, stacked = (bf(B, T, D), bf(B, T, D)), bf(3, B, T, D)
  valid_N = jnp.asarray([True, False, True])
  w = jnp.asarray(rng.normal(size=(D,)), jnp.float32)
  dh = jnp.asarray(rng.normal(size=(B, T, D)), jnp.bfloat16)

  def grads(f):
    _, vjp = jax.vjp(lambda w, s, st_: f(w, s, st_, valid_N), w, sources, stacked)
    return vjp(dh)

  assert attnres_mix(w, sources, stacked, valid_N, 1e-6).dtype == jnp.bfloat16
  got = grads(lambda *a: attnres_mix(*a, 1e-6))
  want = grads(lambda *a: _mix_autodiff(*a).astype(jnp.bfloat16))
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(got[1:]))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b) + 1e-6


def test_mix_rejects_mismatched_shapes():
  from moejax.layers.attnres import attnres_mix

  w = jnp.ones((8,))
  with pytest.raises(ValueError, match="share one"):
    attnres_mix(w, (jnp.ones((1, 2, 8)), jnp.ones((1, 3, 8))), None, None, 1e-6)
  with pytest.raises(ValueError, match="stacked slots"):
    attnres_mix(w, (jnp.ones((1, 2, 8)),), jnp.ones((2, 1, 2, 4)), jnp.ones((2,), bool), 1e-6)
  with pytest.raises(ValueError, match="query must be"):
    attnres_mix(jnp.ones((4,)), (jnp.ones((1, 2, 8)),), None, None, 1e-6)
