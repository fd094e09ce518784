"""Grouped matmul: the Pallas kernels (interpret mode) vs jax.lax.ragged_dot and a float64 NumPy loop,
values and both gradients, over random group sizes (empty groups, one group, sums below and above M,
M/K/N off the tile grid); bf16; the work-list schedule; lowering to Triton IR for an H200; input errors."""

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings

from pallas_kernels.gmm import Tile, Tiling, gmm
from pallas_kernels.gmm.schedule import num_visits, row_tile_visits


def numpy_gmm(x, w, gs, dy):
  """Float64 per-group loop: y, and the lhs/rhs gradients of sum(y * dy). Groups are cut at row M."""
  x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
  m = x.shape[0]
  y, dx, dw = np.zeros((m, w.shape[2])), np.zeros_like(x), np.zeros_like(w)
  end = np.minimum(np.cumsum(np.asarray(gs, np.int64)), m)
  start = np.concatenate([[0], end[:-1]])
  for g, (s, e) in enumerate(zip(start, end, strict=True)):
    y[s:e] = x[s:e] @ w[g]
    dx[s:e] = dy[s:e] @ w[g].T
    dw[g] = x[s:e].T @ dy[s:e]
  return y, dx, dw


def make_inputs(seed, m, k, n, g, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  cast = lambda a: jnp.asarray(a, dtype)
  return (cast(rng.normal(size=(m, k))), cast(rng.normal(size=(g, k, n)) / np.sqrt(k)),
          cast(rng.normal(size=(m, n))))


def fwd_and_grads(impl, tiling=None, out_dtype=None):
  def f(x, w, gs, dy):
    y, vjp = jax.vjp(lambda a, b: gmm(a, b, gs, preferred_element_type=out_dtype, tiling=tiling,
                                      implementation=impl), x, w)
    return (y, *vjp(dy.astype(y.dtype)))
  return f


def assert_close(actual, expected, rtol):
  """Per leaf: |a - e| <= rtol * (|e| + max|e|), so tiny entries are judged against the leaf's scale."""
  for a, e in zip(actual, expected, strict=True):
    e = np.asarray(e, np.float64)
    scale = max(np.max(np.abs(e)), 1.0)
    chex.assert_trees_all_close(np.asarray(a, np.float64), e, rtol=rtol, atol=rtol * scale)


# M, K, N all off the 16-tile grid: masked rows, contraction tail and output columns.
M, K, N, G = 70, 40, 24, 5
TILE16 = Tile(bm=16, bk=16, bn=16, num_warps=4, num_stages=2)
X, W, DY = make_inputs(0, M, K, N, G)


_xla_fg = jax.jit(fwd_and_grads("xla"))


@pytest.fixture(scope="module")
def interpret_fg():
  """The jitted interpret-mode function and a list that grows by one per trace of it."""
  traces = []

  def f(x, w, gs, dy):
    traces.append(1)
    return fwd_and_grads("interpret", TILE16)(x, w, gs, dy)

  f = jax.jit(f)
  # The first lowering imports JAX's lazily loaded Pallas modules, which changes the trace context once:
  # lowered (not compiled) here, the tests' first call traces and compiles once more, and only once.
  f.lower(X, W, jnp.zeros((G,), jnp.int32), DY)
  traces.clear()
  return f, traces


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=G, max_size=G))
@example([0, 0, 0, 0, 0])          # nothing routed: all zeros, zero gradients
@example([0, 0, M, 0, 0])          # one group takes every row
@example([3, 16, 0, 1, 9])         # sum < M: zero tail; boundaries inside tiles
@example([16, 16, 16, 16, 6])      # boundaries on the tile grid, sum == M
@example([50, 0, 60, 7, 7])        # sum > M: groups cut at row M
def test_matches_ragged_dot_and_numpy(interpret_fg, sizes):
  f, traces = interpret_fg
  gs = jnp.asarray(sizes, jnp.int32)
  got = f(X, W, gs, DY)
  assert len(traces) <= 1, "new group sizes must not retrace"
  assert_close(got, _xla_fg(X, W, gs, DY), rtol=1e-5)
  assert_close(got, numpy_gmm(X, W, sizes, DY), rtol=1e-5)


_ALIGNED_TILING = Tiling(fwd=Tile(32, 16, 16), dlhs=Tile(16, 16, 32), drhs=Tile(16, 32, 16))
_aligned_fg = jax.jit(fwd_and_grads("interpret", _ALIGNED_TILING))


def test_tile_aligned_shapes_with_per_kernel_tiles():
  """M, K, N multiples of every tile: the unmasked load/store paths, and a distinct tile per kernel."""
  x, w, dy = make_inputs(1, 64, 32, 32, 3)
  for sizes in ([64, 0, 0], [0, 7, 41], [20, 20, 24]):
    got = _aligned_fg(x, w, jnp.asarray(sizes, jnp.int32), dy)
    assert_close(got, numpy_gmm(x, w, sizes, dy), rtol=1e-5)


def test_bf16_inputs_float32_accumulation():
  """bf16 operands, default tiles (fitted down to the small shape), float32 and bf16 outputs."""
  x, w, dy = make_inputs(2, 48, 32, 32, 4, jnp.bfloat16)
  sizes = [10, 0, 30, 3]
  gs = jnp.asarray(sizes, jnp.int32)
  y32, dx, dw = jax.jit(fwd_and_grads("interpret", None, jnp.float32))(x, w, gs, dy)
  assert y32.dtype == jnp.float32 and dx.dtype == dw.dtype == jnp.bfloat16
  # Products of bf16 values are exact in float32, so the float32 output is tight; the gradients go
  # through a bf16 cotangent and bf16 outputs.
  y_ref, dx_ref, dw_ref = numpy_gmm(x, w, sizes, dy)
  assert_close([y32], [y_ref], rtol=1e-5)
  assert_close([dx, dw], [dx_ref, dw_ref], rtol=2e-2)
  y16 = jax.jit(lambda a, b, s: gmm(a, b, s, implementation="interpret"))(x, w, gs)
  assert y16.dtype == jnp.bfloat16
  assert_close([y16], [y_ref], rtol=1e-2)


def fwd_and_grads_accumulating(impl, tiling=None):
  """(y, dlhs, drhs, d accumulator) of gmm with a gradient accumulator; lhs bf16, rhs float32."""
  def f(x, w, acc, gs, dy):
    y, vjp = jax.vjp(lambda a, b, c: gmm(a, b, gs, preferred_element_type=jnp.float32, tiling=tiling,
                                         implementation=impl, rhs_grad_acc=c), x, w, acc)
    return (y, *vjp(dy.astype(y.dtype)))
  return f


_acc_fgs = {impl: jax.jit(fwd_and_grads_accumulating(impl, TILE16)) for impl in ("interpret", "xla")}


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=G, max_size=G), st.integers(0, 2**31 - 1))
@example([0, 0, 0, 0, 0], 0)        # nothing routed: drhs is the accumulator as it was
@example([50, 0, 60, 7, 7], 1)      # sum > M: groups cut at row M; empty groups keep their accumulator
@example([3, 16, 0, 1, 9], 2)       # sum < M
def test_gradient_accumulator(sizes, seed):
  """rhs float32 with bf16 lhs: the products use rhs rounded to bf16, drhs is accumulator + the float64
  gradient of the rounded operands (not rounded to bf16 before the sum), the accumulator's cotangent
  is zero; the Pallas kernels (interpret) and the XLA form alike."""
  x, w, dy = make_inputs(seed % 1000, M, K, N, G)
  x16, w16, dy16 = (a.astype(jnp.bfloat16) for a in (x, w, dy))
  acc = jnp.asarray(np.random.default_rng(seed % 1000 + 1).normal(size=W.shape), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  y_ref, dx_ref, dw_ref = numpy_gmm(x16, w16, sizes, dy16)
  for impl, f in _acc_fgs.items():
    y, dx, dw, dacc = f(x16, w, acc, gs, dy)
    assert y.dtype == dw.dtype == jnp.float32 and dx.dtype == jnp.bfloat16, impl
    assert_close([y, dw], [y_ref, np.asarray(acc, np.float64) + dw_ref], rtol=1e-5)
    assert_close([dx], [dx_ref], rtol=1e-2)
    np.testing.assert_array_equal(dacc, np.zeros_like(acc))


def test_gradient_accumulator_sums_passes():
  """Three passes, each feeding the last pass's drhs back as the accumulator: the sum of the passes'
  gradients, as accumulation over microbatches uses it; interpret mode against the XLA form."""
  f = _acc_fgs["interpret"]
  acc = jnp.zeros(W.shape, jnp.float32)
  expected = np.zeros(W.shape)
  for p, sizes in enumerate(([10, 20, 0, 30, 10], [0, 70, 0, 0, 0], [5, 5, 5, 5, 5])):
    x, _, dy = make_inputs(10 + p, M, K, N, G)
    x16 = x.astype(jnp.bfloat16)
    _, _, acc, _ = f(x16, W, acc, jnp.asarray(sizes, jnp.int32), dy)
    expected += numpy_gmm(x16, W.astype(jnp.bfloat16), sizes, dy.astype(jnp.bfloat16))[2]
  assert_close([acc], [expected], rtol=1e-5)


_visits = jax.jit(row_tile_visits, static_argnums=(1, 2))


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([37, 64, 100]), st.sampled_from([16, 32]), st.data())
def test_schedule_covers_every_row_once(m, bm, data):
  g = 6
  sizes = data.draw(st.lists(st.integers(0, m // 2), min_size=g, max_size=g))
  v = jax.tree.map(np.asarray, _visits(jnp.asarray(sizes, jnp.int32), m, bm))
  assert v.group_V.shape == (num_visits(m, g, bm),)
  owner = np.full(m, -1)
  end = np.minimum(np.cumsum(sizes), m)
  expected = np.searchsorted(end, np.arange(m), side="right")   # G for the zero tail
  for grp, t, lo, hi in zip(*v, strict=True):
    if lo == hi:
      continue
    assert t * bm <= lo < hi <= min(t * bm + bm, m)
    assert (owner[lo:hi] == -1).all()
    owner[lo:hi] = grp
  np.testing.assert_array_equal(owner, expected)


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("dtype,shape", [(jnp.bfloat16, (1000, 256, 192, 8)), (jnp.float32, (64, 64, 64, 2))])
def test_lowers_to_triton_for_h200(dtype, shape):
  """The GPU path (forward, dlhs, drhs) lowers to Triton IR for an abstract H200, without a GPU."""
  from pallas_kernels.gmm.ops import _gmm
  from pallas_kernels.gmm.tiling import DEFAULT_TILING
  m, k, n, g = shape
  args = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((g, k, n), dtype),
          jax.ShapeDtypeStruct((g,), jnp.int32))

  def f(x, w, gs):
    y, vjp = jax.vjp(lambda a, b: _gmm(a, b, gs, jnp.float32, DEFAULT_TILING, False), x, w)
    return y, vjp(y)

  h200 = jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)):
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 3


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("shape", [(1000, 256, 192, 8), (1024, 256, 256, 4)])  # partial, whole tiles
def test_accumulating_drhs_lowers_in_place_for_h200(shape):
  """With a gradient accumulator the drhs kernel lowers to Triton for an H200 with its output aliased
  to the accumulator (whether XLA then copies is the compiled step's business: tools/hlo_traffic.py
  showed none in experiments/h200.py's step)."""
  from pallas_kernels.gmm.ops import _gmm_acc
  from pallas_kernels.gmm.tiling import DEFAULT_TILING
  m, k, n, g = shape
  args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((g, k, n), jnp.float32),
          jax.ShapeDtypeStruct((g, k, n), jnp.float32), jax.ShapeDtypeStruct((g,), jnp.int32))

  def f(x, w, acc, gs):
    y, vjp = jax.vjp(lambda a, b: _gmm_acc(a, b, gs, acc, jnp.bfloat16, DEFAULT_TILING, "pallas"), x, w)
    return vjp(y)

  h200 = jax.sharding.AbstractDevice("NVIDIA H200", 132, "gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)):
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("xla.gpu.triton") == 3
  assert text.count("output_operand_aliases") == 1


def test_default_implementation_off_gpu_is_xla():
  x, w, _ = make_inputs(3, 8, 16, 16, 2)
  gs = jnp.asarray([3, 4], jnp.int32)
  np.testing.assert_array_equal(gmm(x, w, gs), jax.lax.ragged_dot(x, w, gs))


@pytest.mark.parametrize("args,kwargs,match", [
    ((X[0], W, jnp.ones(G, jnp.int32)), {}, "lhs must be"),
    ((X, W[0], jnp.ones(G, jnp.int32)), {}, "rhs must be"),
    ((X, W, jnp.ones((G, 1), jnp.int32)), {}, "group_sizes must be"),
    ((X, W, jnp.ones(G, jnp.float32)), {}, "must be integer"),
    ((X[:, :8], W, jnp.ones(G, jnp.int32)), {}, "contraction"),
    ((X, W, jnp.ones(G + 1, jnp.int32)), {}, "group count"),
    ((X, W.astype(jnp.bfloat16), jnp.ones(G, jnp.int32)), {}, "one floating dtype"),
    ((X.astype(jnp.int32), W.astype(jnp.int32), jnp.ones(G, jnp.int32)), {}, "one floating dtype"),
    ((X, W, jnp.ones(G, jnp.int32)), {"preferred_element_type": jnp.int32}, "must be floating"),
    ((X, W, jnp.ones(G, jnp.int32)), {"implementation": "triton"}, "unknown gmm implementation"),
    ((X, W, jnp.ones(G, jnp.int32)), {"implementation": "pallas"}, "needs a GPU"),
    ((X, W, jnp.ones(G, jnp.int32)), {"tiling": (16, 16, 16)}, "tiling must be"),
    ((X, W, jnp.ones(G, jnp.int32)), {"rhs_grad_acc": W[:, :8]}, "rhs_grad_acc must have"),
    ((X.astype(jnp.bfloat16), W, jnp.ones(G, jnp.int32)), {"rhs_grad_acc": W.astype(jnp.bfloat16)},
     "rhs_grad_acc must have"),
])
def test_bad_inputs_raise(args, kwargs, match):
  with pytest.raises(ValueError, match=match):
    gmm(*args, **kwargs)


@pytest.mark.parametrize("kwargs", [{"bm": 24}, {"bk": 8}, {"bn": True}, {"num_warps": 0}])
def test_bad_tile_raises(kwargs):
  with pytest.raises(ValueError, match="Tile"):
    Tile(**kwargs)
