"""The fused grouped SiTU-GLU (pallas_kernels.gmm.situ_glu) in Pallas interpret mode, against plain JAX
autodiff of a per-group loop (no custom VJP, no ragged_dot), values and all four gradients: random group
sizes (empty groups, sums below and above R), sizes off the tile grid, pre-activations past both tanh
bounds, bf16; lowering to Triton for an H200; one trace per shape; input errors."""

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings

from pallas_kernels.gmm import Tile
from pallas_kernels.gmm.situ_glu import GLUTiling, grouped_situ_glu_fused

B1, B2 = 4.0, 25.0
G, R, L, F = 4, 70, 40, 24  # R, L, F off the 16-tile grid
TILES = GLUTiling.of(Tile(bm=16, bk=16, bn=16, num_warps=4, num_stages=2))


def loop_reference(x, sizes, w_gate, w_up, w_down):
  """Group by group with jnp.tanh and jax.nn.sigmoid, differentiated by JAX itself."""
  ends = np.minimum(np.cumsum(sizes), x.shape[0])
  starts = np.concatenate([[0], ends[:-1]])
  y = jnp.zeros((x.shape[0], w_down.shape[2]), x.dtype)
  for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
    gate, up = x[s:e] @ w_gate[g], x[s:e] @ w_up[g]
    h = B1 * jnp.tanh(gate / B1) * jax.nn.sigmoid(gate) * B2 * jnp.tanh(up / B2)
    y = y.at[s:e].set(h @ w_down[g])
  return y


def make_inputs(seed, dtype=jnp.float32, gain=1.0):
  rng = np.random.default_rng(seed)
  cast = lambda a: jnp.asarray(a, dtype)
  x = cast(rng.normal(size=(R, L)))
  ws = (cast(gain * rng.normal(size=(G, L, F)) / np.sqrt(L)),
        cast(gain * rng.normal(size=(G, L, F)) / np.sqrt(L)), cast(rng.normal(size=(G, F, L)) / np.sqrt(F)))
  return x, ws, cast(rng.normal(size=(R, L)))


def value_and_grads(f, x, ws, dy):
  y, vjp = jax.vjp(f, x, *ws)
  return (y, *vjp(dy.astype(y.dtype)))


def fused(sizes, tiling=TILES):
  return lambda x, *w: grouped_situ_glu_fused(x, sizes, *w, B1, B2, tiling=tiling, interpret=True)


def assert_close(actual, expected, rtol):
  """Per leaf, against the leaf's own scale: |a - e| <= rtol * (|e| + max|e|)."""
  for a, e in zip(actual, expected, strict=True):
    e = np.asarray(e, np.float64)
    scale = max(np.max(np.abs(e)), 1e-6)
    chex.assert_trees_all_close(np.asarray(a, np.float64), e, rtol=rtol, atol=rtol * scale)


@settings(max_examples=4, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=G, max_size=G), st.integers(0, 2**16))
@example([0, 0, 0, 0], 0)        # nothing routed: zeros, zero gradients
@example([3, 16, 0, 40], 1)      # sum < R: a zero tail; boundaries inside tiles
@example([50, 0, 30, 7], 2)      # sum > R: groups cut at row R
def test_matches_autodiff_of_a_group_loop(sizes, seed):
  sizes = np.asarray(sizes, np.int32)
  x, ws, dy = make_inputs(seed)
  got = jax.jit(lambda x, ws, dy: value_and_grads(fused(jnp.asarray(sizes)), x, ws, dy))(x, ws, dy)
  want = value_and_grads(lambda x, *w: loop_reference(x, sizes, *w), x, ws, dy)
  assert_close(got, want, rtol=2e-5)
  used = min(int(sizes.sum()), R)
  assert not np.any(np.asarray(got[0][used:])) and not np.any(np.asarray(got[1][used:]))


def test_pre_activations_past_the_bounds():
  """Weights 40x larger put |gate| and |up| well past b1 and b2, where tanh saturates: h stays within
  b1 b2 and the gradients still match."""
  sizes = np.asarray([20, 10, 25, 15], np.int32)
  x, ws, dy = make_inputs(3, gain=40.0)
  gate, up = np.asarray(x[:20] @ ws[0][0]), np.asarray(x[:20] @ ws[1][0])
  assert np.abs(gate).max() > 4 * B1 and np.abs(up).max() > 2 * B2
  got = value_and_grads(fused(jnp.asarray(sizes)), x, ws, dy)
  want = value_and_grads(lambda x, *w: loop_reference(x, sizes, *w), x, ws, dy)
  assert_close(got, want, rtol=5e-5)


def test_bfloat16_against_float32():
  """bf16 operands (float32 accumulation and element-wise math) within 1e-2 of float32 on the same
  bf16-representable inputs, forward and gradients."""
  sizes = jnp.asarray([12, 0, 40, 16], jnp.int32)
  x, ws, dy = make_inputs(4, jnp.bfloat16)
  f32 = lambda t: t.astype(jnp.float32)
  got = jax.jit(lambda x, ws, dy: value_and_grads(fused(sizes), x, ws, dy))(x, ws, dy)
  want = value_and_grads(fused(sizes), f32(x), tuple(map(f32, ws)), f32(dy))
  assert all(a.dtype == jnp.bfloat16 for a in got)
  for a, b in zip(got, want, strict=True):
    assert float(jnp.linalg.norm(f32(a) - b) / jnp.linalg.norm(b)) < 1e-2


def test_one_trace_per_shape():
  """The epilogues compare by value, so a new but equal tiling or bound reuses the compiled op."""
  from pallas_kernels.gmm import situ_glu

  x, ws, _ = make_inputs(5)
  sizes = jnp.asarray([10, 20, 30, 10], jnp.int32)
  jax.block_until_ready(fused(sizes)(x, *ws))
  before = situ_glu._glu_jit._cache_size()
  tiles = GLUTiling.of(Tile(bm=16, bk=16, bn=16, num_warps=4, num_stages=2))
  jax.block_until_ready(fused(sizes + 1, tiles)(x, *ws))
  assert situ_glu._glu_jit._cache_size() == before


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_to_triton_for_h200(dtype):
  """Forward (gate/up with SiTU-GLU, down) and backward (dh with the SiTU-GLU gradient, dx, three
  weight gradients): seven Triton kernels at the default tiles, lowered for an abstract H200."""
  r, l_in, f, g = 1000, 256, 192, 8
  shape = lambda *s: jax.ShapeDtypeStruct(s, dtype)
  args = (shape(r, l_in), jax.ShapeDtypeStruct((g,), jnp.int32), shape(g, l_in, f), shape(g, l_in, f),
          shape(g, f, l_in))

  def f(x, sizes, *ws):
    y, vjp = jax.vjp(lambda x, *w: grouped_situ_glu_fused(x, sizes, *w, B1, B2), x, *ws)
    return y, vjp(y)

  h200 = jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)):
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 7


@pytest.mark.parametrize("bad,match", [
    (dict(w_down=jnp.zeros((G, L, F))), "w_down must be"),
    (dict(w_up=jnp.zeros((G, L, F), jnp.bfloat16)), "w_up must be"),
    (dict(sizes=jnp.zeros((G + 1,), jnp.int32)), "group_sizes must be"),
    (dict(sizes=jnp.zeros((G,), jnp.float32)), "group_sizes must be"),
])
def test_bad_inputs_raise(bad, match):
  x, (w_gate, w_up, w_down), _ = make_inputs(6)
  a = dict(sizes=jnp.zeros((G,), jnp.int32), w_gate=w_gate, w_up=w_up, w_down=w_down) | bad
  with pytest.raises(ValueError, match=match):
    grouped_situ_glu_fused(x, a["sizes"], a["w_gate"], a["w_up"], a["w_down"], B1, B2, interpret=True)
