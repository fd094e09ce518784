"""The Pallas KDA kernels in interpret mode (CPU) against the XLA chunked form and the token-by-token
recurrence: values and every gradient (q, k, v, g, beta, initial state), odd lengths, packed documents,
state in and out, gates at the bound, widths that need padding and several column blocks per kernel."""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from references import doc_lengths, ids_from_lengths

from pallas_kernels.kda import chunk_kda, tiles
from pallas_kernels.kda.config import Config, segment_programs
from pallas_kernels.kda.inputs import resets
from pallas_kernels.kda.ops import chunk_kda_pallas
from pallas_kernels.kda.tuning import MIN_SEGMENTED_CHUNKS

LB = -5.0


def make_inputs(seed, B, T, H, K, V, dtype=jnp.float32, gate=None):
  """q, k unit rows; gates uniform in [-5, 0) with ~10% exactly at -5 (or all equal to `gate`)."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k = unit(rng.normal(size=(B, T, H, K))), unit(rng.normal(size=(B, T, H, K)))
  v = rng.normal(size=(B, T, H, V))
  g = rng.uniform(LB, 0.0, size=(B, T, H, K))
  g[rng.uniform(size=g.shape) < 0.1] = LB
  if gate is not None:
    g[:] = gate
  beta = rng.uniform(0.0, 1.0, size=(B, T, H))
  S0 = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
  cotangents = (jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32),
                jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v, g, beta)), S0, cotangents


def run(impl, qkvgb, S0, segment_ids, *, C, scale=None, config=None):
  """(o, final state) by `impl`; "kernel" calls the Pallas op directly with an explicit Config."""
  if impl == "kernel":
    K = qkvgb[0].shape[-1]
    return chunk_kda_pallas(*qkvgb, K**-0.5 if scale is None else scale, S0, resets(segment_ids),
                            chunk_size=C, output_final_state=True, interpret=True, config=config)
  return chunk_kda(*qkvgb, scale=scale, initial_state=S0, output_final_state=True, segment_ids=segment_ids,
                   chunk_size=C, implementation=impl)


@functools.partial(jax.jit, static_argnames=("impl", "C", "scale", "config"))
def value_and_vjp(qkvgb, S0, segment_ids, cotangents, *, impl, C, scale=None, config=None):
  f = lambda qkvgb, S0: run(impl, qkvgb, S0, segment_ids, C=C, scale=scale, config=config)
  out, vjp = jax.vjp(f, qkvgb, S0)
  return out, vjp(cotangents)


def assert_close(actual, expected, rtol):
  """Per leaf: |a - e| <= rtol * (|e| + max|e|), so tiny entries are judged against the leaf's scale."""
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * np.max(np.abs(e)))


def rel_err(a, e):
  a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
  return np.linalg.norm(a - e) / np.linalg.norm(e)


# Odd lengths, one partial chunk, padded widths (K 40 -> 64, V 24 -> 32), several K and V blocks per
# kernel (block 16), V blocks of the state passes narrower than V, scale given, state from zero, chunks
# 16 to 128.
CASES = {
    "T50-C16-docs": dict(T=50, C=16, H=2, K=16, V=16, docs=[5, 11, 16, 1, 17], scale=None,
                         config=Config(block=16, block_fwd=16, block_v_fwd=16, block_v_bwd=16)),
    "T131-C32-padded-blocks": dict(T=131, C=32, H=1, K=40, V=24, docs=[32, 1, 40, 58], scale=0.3,
                                   config=Config(block=16, block_fwd=16, block_v_fwd=16, block_v_bwd=32)),
    "T17-C64-api": dict(T=17, C=64, H=2, K=8, V=4, docs=None, scale=None, config="api"),
    # The forward's solve doubles over the whole chunk: 7 levels at 128.
    "T150-C128-docs": dict(T=150, C=128, H=1, K=40, V=16, docs=[90, 60], scale=None,
                           config=Config(block=16, block_fwd=16)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_xla_and_recurrence(name):
  c = CASES[name]
  B = 2
  qkvgb, S0, cot = make_inputs(len(name), B, c["T"], c["H"], c["K"], c["V"])
  seg = None if c["docs"] is None else jnp.asarray(np.stack([ids_from_lengths(c["docs"])] * B), jnp.int32)
  impl, config = ("interpret", None) if c["config"] == "api" else ("kernel", c["config"])
  got = value_and_vjp(qkvgb, S0, seg, cot, impl=impl, C=c["C"], scale=c["scale"], config=config)
  for ref_impl in ("xla", "recurrent"):
    want = value_and_vjp(qkvgb, S0, seg, cot, impl=ref_impl, C=c["C"], scale=c["scale"])
    assert_close(got, want, rtol=1e-4)
  for x in jax.tree.leaves(got):
    assert np.all(np.isfinite(x)) and np.any(x != 0)


@settings(max_examples=5, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(0, 2**16))
def test_random_document_layouts(lengths, seed):
  """Random packings at one shape (one compile): the row is cut into documents of the drawn lengths."""
  T, C = 70, 32
  doc = doc_lengths(lengths, T)
  qkvgb, S0, cot = make_inputs(seed, 1, T, 1, 16, 16)
  seg = jnp.asarray(ids_from_lengths(doc)[None], jnp.int32)
  got = value_and_vjp(qkvgb, S0, seg, cot, impl="kernel", C=C, config=Config(block=16, block_fwd=16))
  want = value_and_vjp(qkvgb, S0, seg, cot, impl="recurrent", C=C)
  assert_close(got, want, rtol=1e-4)


def test_no_gradient_crosses_a_document_boundary():
  """Loss on the last document only: every earlier gradient and the initial state's are exact zeros,
  and so is the gradient of the gate at the document start (it decays a state that was reset)."""
  T, start = 80, 37
  qkvgb, S0, _ = make_inputs(3, 1, T, 1, 16, 16)
  seg = jnp.asarray(np.arange(T)[None] >= start, jnp.int32)

  @jax.jit
  def grads(qkvgb, S0):
    def loss(qkvgb, S0):
      o, S = run("kernel", qkvgb, S0, seg, C=32, config=Config(block=16, block_fwd=16))
      return jnp.sum(o[:, start:] ** 2) + jnp.sum(S**2)
    return jax.grad(loss, argnums=(0, 1))(qkvgb, S0)

  (dq, dk, dv, dg, db), dS0 = grads(qkvgb, S0)
  np.testing.assert_array_equal(dS0, 0.0)
  for grad in (dq, dk, dv, dg, db):
    np.testing.assert_array_equal(grad[:, :start], 0.0)
    assert np.any(grad[:, start + 1:] != 0)
  np.testing.assert_array_equal(dg[:, start], 0.0)


def test_bf16_with_every_gate_at_the_bound():
  """bf16 inputs, g = -5 everywhere: finite, and within 1e-2 of the float32 recurrence on the same
  inputs for the output, the final state and every gradient."""
  B, T, H, K, V = 1, 200, 2, 32, 32
  qkvgb, S0, cot = make_inputs(4, B, T, H, K, V, dtype=jnp.bfloat16, gate=LB)
  cot = (cot[0].astype(jnp.bfloat16), cot[1])
  got = value_and_vjp(qkvgb, S0, None, cot, impl="kernel", C=32, config=Config(block=16, block_fwd=16))
  f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  want = value_and_vjp(f32(qkvgb), S0, None, f32(cot), impl="recurrent", C=32)
  assert got[0][0].dtype == jnp.bfloat16 and got[0][1].dtype == jnp.float32
  for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert np.all(np.isfinite(np.asarray(a, np.float32)))
    assert rel_err(a, e) <= 1e-2


def test_bf16_data_with_float32_gates_as_the_model_feeds_them():
  """The KDA layer hands bf16 q, k, v, beta with float32 gates (packed documents, state in and out):
  every output and gradient within 1e-2 of the float32 recurrence, dg returned in float32."""
  B, T, H, K, V = 2, 77, 2, 32, 16
  qkvgb, S0, cot = make_inputs(5, B, T, H, K, V)
  mixed = tuple(x if i == 3 else x.astype(jnp.bfloat16) for i, x in enumerate(qkvgb))
  segment_ids = jnp.asarray(np.stack([ids_from_lengths([30, 47]), ids_from_lengths([77])]))
  got = value_and_vjp(mixed, S0, segment_ids, (cot[0].astype(jnp.bfloat16), cot[1]), impl="kernel", C=32,
                      config=Config(block=16, block_fwd=16))
  f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  want = value_and_vjp(f32(mixed), S0, segment_ids, cot, impl="recurrent", C=32)
  assert got[1][0][3].dtype == jnp.float32
  for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert rel_err(a, e) <= 1e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_in_kernel_gate_cumsum_is_exact_to_float32_rounding(dtype):
  """The kernels' G (float32 gates split into three bf16 parts for the dots) against float64 prefix
  sums: whole chunk, every 16-row tile and single rows, gates down to the bound; a row equals its own
  tile's row bit for bit."""
  rng = np.random.default_rng(0)
  g = jnp.asarray(rng.uniform(LB, 0.0, size=(64, 32)), dtype)
  g = g.at[::7].set(LB)
  want = np.cumsum(np.asarray(g, np.float64), axis=0)
  G = tiles.gate_cumsum(tiles.Chunk(1, lambda i: g, None)).block(0)
  tol = 4 * np.finfo(np.float32).eps * np.abs(want).max()
  np.testing.assert_allclose(np.asarray(G.full()), want, rtol=0, atol=tol)
  for p in range(4):
    np.testing.assert_allclose(np.asarray(G.tile(p)), want[16 * p:16 * (p + 1)], rtol=0, atol=tol)
  for r in (0, 15, 16, 63):
    np.testing.assert_array_equal(np.asarray(G.row(r)), np.asarray(G.tile(r // 16))[r % 16])
    np.testing.assert_allclose(np.asarray(G.row(r)), want[r], rtol=0, atol=tol)


@pytest.mark.parametrize("n", [2, 16, 32, 64])
def test_solve_inverse_against_float64(n):
  """tiles.inverse, (I + A)^{-1} by doubling for a strictly lower-triangular A, against float64,
  at exact float32 dots, for entries of both signs and a row scale like the op's beta."""
  rng = np.random.default_rng(n)
  A = np.tril(rng.uniform(-1.0, 1.0, size=(n, n)), -1) * rng.uniform(0.0, 1.0, size=(n, 1)) / np.sqrt(n)
  want = np.linalg.inv(np.eye(n) + A)
  got = np.asarray(tiles.inverse(jnp.asarray(A, jnp.float32), tiles.precision_for(jnp.float32)))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
  assert np.all(got[np.triu_indices(n, 1)] == 0) and np.all(np.diag(got) == 1)


@pytest.mark.parametrize("fwd,bwd,lengths", [
    ("mosaic", "triton", (41, 59)), ("mosaic", "mosaic", (41, 59)), ("triton", "mosaic", (41, 59)),
    ("mosaic", "mosaic", (32, 20, 48))])
def test_mosaic_state_pass_matches_triton_in_the_op(fwd, bwd, lengths):
  """The op with either state pass on Mosaic GPU (interpret mode) against the same op on Triton and the
  float32 recurrence: bf16 data, K=V=64, packed documents, state in and out, every gradient (the
  backward pass reads the states and V' that the forward keeps, and its state pass makes dV' and the
  states' cotangents for the rest of the backward). Documents end inside a chunk and (lengths 32, 20,
  48) on a chunk boundary."""
  B, T, H, K, V = 1, 100, 1, 64, 64
  qkvgb, S0, cot = make_inputs(6, B, T, H, K, V, dtype=jnp.bfloat16)
  qkvgb = tuple(x.astype(jnp.float32) if i == 3 else x for i, x in enumerate(qkvgb))
  cot = (cot[0].astype(jnp.bfloat16), cot[1])
  segment_ids = jnp.asarray(ids_from_lengths(list(lengths)))[None]
  got = value_and_vjp(qkvgb, S0, segment_ids, cot, impl="kernel", C=32,
                      config=Config(scan_fwd_lowering=fwd, scan_bwd_lowering=bwd))
  triton = value_and_vjp(qkvgb, S0, segment_ids, cot, impl="kernel", C=32,
                         config=Config(scan_fwd_lowering="triton", scan_bwd_lowering="triton"))
  f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  want = value_and_vjp(f32(qkvgb), S0, segment_ids, f32(cot), impl="recurrent", C=32)
  for a, t, e in zip(jax.tree.leaves(got), jax.tree.leaves(triton), jax.tree.leaves(want), strict=True):
    assert rel_err(a, t) <= 2e-3
    assert rel_err(a, e) <= 1e-2


@pytest.mark.parametrize("segments,slots,block_v,lengths,gate",
                         [(2, None, None, (41, 60, 49), -0.02), (3, None, 32, None, LB),
                          (4, None, None, (150,), -0.02)])
def test_segmented_state_pass_in_the_op(segments, slots, block_v, lengths, gate):
  """The forward alone with its Mosaic state pass in segments (interpret mode): bf16 data, mild gates so
  that states carry across segments (or every gate at the bound), initial and final state, documents
  that start inside segments. T = 150 is five chunks: segments of 4 + 1 and 2 + 2 + 1 chunks, and for
  four segments (at one slot, as by default) the row padded to 8 chunks; V blocks of 64 (the default
  here) and 32. Within the bf16 target of the float32 recurrence and close to the unsegmented op; the
  gradient path keeps its states and never segments, so its values and gradients are the unsegmented
  op's exactly."""
  B, T, H, K, V = 1, 150, 1, 64, 64
  qkvgb, S0, cot = make_inputs(8, B, T, H, K, V, dtype=jnp.bfloat16, gate=gate)
  cot = (cot[0].astype(jnp.bfloat16), cot[1])
  seg = None if lengths is None else jnp.asarray(ids_from_lengths(list(lengths)))[None]
  config = Config(scan_fwd_lowering="mosaic", scan_segments=segments, segment_slots=slots,
                  segment_block_v=block_v)
  got = run("kernel", qkvgb, S0, seg, C=32, config=config)
  one = Config(scan_fwd_lowering="mosaic", scan_segments=1)
  whole = run("kernel", qkvgb, S0, seg, C=32, config=one)
  want = run("recurrent", tuple(x.astype(jnp.float32) for x in qkvgb), S0, seg, C=32)
  for a, w, e in zip(got, whole, want, strict=True):
    assert a.shape == e.shape and a.dtype == w.dtype
    assert rel_err(a, e) <= 1e-2
    assert rel_err(a, w) <= 3e-3
  grads = value_and_vjp(qkvgb, S0, seg, cot, impl="kernel", C=32, config=config)
  grads_whole = value_and_vjp(qkvgb, S0, seg, cot, impl="kernel", C=32, config=one)
  jax.tree.map(np.testing.assert_array_equal, grads, grads_whole)


def test_scan_segments_setting():
  long = MIN_SEGMENTED_CHUNKS
  # Where the whole pass has at most 64 programs of 32 columns (16 where V is 16) over a long row, the
  # most segments, up to four, whose programs 132 SMs hold at once (2 an SM at 64 columns, 3 at fewer);
  # else one.
  assert segment_programs(1, 16, 128, 128, 64, 4) == 224 and segment_programs(1, 16, 256, 128, 64, 4) == 320
  assert Config().segments(1, 16, 128, 128, long) == 4
  assert Config().segments(1, 16, 256, 128, long) == 3  # 4 would be 320 programs of 64 columns
  assert Config().segments(1, 16, 128, 16, long) == 3   # 4 would be 448 of 16
  assert Config().segments(1, 16, 256, 16, long) == 2
  assert Config(block_v_fwd=32).segments(1, 16, 128, 128, long) == 3
  assert Config().segments(2, 16, 128, 128, long) == 1
  assert Config().segments(1, 16, 128, 128, long - 1) == 1
  # The homogeneous pass walks K in V blocks: none where they do not divide K.
  assert Config(block_v_fwd=128).segments(1, 1, 64, 128, long) == 1
  with pytest.raises(ValueError, match="V blocks that divide K"):
    Config(block_v_fwd=128, scan_segments=2).segments(1, 1, 64, 128, long)
  assert Config(scan_segments=1).segments(1, 16, 128, 128, long) == 1
  assert Config(scan_segments=4).segments(2, 16, 128, 128, 4) == 4
  for bad in (0, True, 1.5, "2"):
    with pytest.raises(ValueError, match="scan_segments"):
      Config(scan_segments=bad)
  # Their V blocks: 64 where 64 divides K and V, else the scans' own; block_v_fwd or segment_block_v
  # where set, at most V.
  assert Config().segment_block_v_for(128, 128) == 64
  assert Config().segment_block_v_for(128, 16) == 16 and Config().segment_block_v_for(128, 32) == 32
  assert Config(block_v_fwd=16).segment_block_v_for(128, 128) == 16
  assert Config(block_v_fwd=32, segment_block_v=128).segment_block_v_for(128, 64) == 64
  assert Config(segment_block_v=32).segments(1, 16, 128, 128, long) == 3
  with pytest.raises(ValueError, match="segment_block_v=128 must divide the key width 64"):
    Config(segment_block_v=128).segments(1, 16, 64, 128, long)
  with pytest.raises(ValueError, match="segment_block_v must be a power of two"):
    Config(segment_block_v=48)
  # Their slots: one from three segments on (two or three programs an SM, at 64 or 32 columns), else the
  # scans' own.
  assert Config().segment_slots_for(3) == Config().segment_slots_for(4) == 1
  assert Config(mosaic_slots=3).segment_slots_for(2) == 3
  assert Config(segment_slots=2).segment_slots_for(3) == 2
  for bad in (0, True, 1.5, "2"):
    with pytest.raises(ValueError, match="segment_slots"):
      Config(segment_slots=bad)


def test_segment_slots_that_do_not_fit_are_refused():
  qkvgb, _, _ = make_inputs(1, 1, 64, 1, 128, 128, dtype=jnp.bfloat16)
  config = Config(scan_fwd_lowering="mosaic", scan_segments=2, segment_slots=8)
  with pytest.raises(ValueError, match="2 segments of 64 columns at 8 slots: .*shared memory"):
    chunk_kda_pallas(*qkvgb, 128**-0.5, None, None, chunk_size=32, output_final_state=False, interpret=True,
                     config=config)


def test_interpret_mode_differentiates_under_remat_at_mosaic_shapes():
  """Shapes where the GPU would take the Mosaic state pass (bf16, K = V = 64): in interpret mode the
  default lowering still differentiates inside jax.checkpoint, as the 1M configs' remat needs (Mosaic's
  interpreter, with its ordered I/O callbacks, cannot)."""
  qkvgb, _, _ = make_inputs(7, 1, 32, 1, 64, 64, dtype=jnp.bfloat16)
  loss = jax.checkpoint(lambda *a: jnp.sum(chunk_kda(*a, chunk_size=32, implementation="interpret")[0]
                                            .astype(jnp.float32)))
  grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*qkvgb)
  assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in grads)


def test_state_pass_lowering_follows_what_mosaic_supports():
  bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
  assert Config().scan_lowering(32, 128, 128, bf16) == "mosaic"
  assert Config().scan_lowering(64, 128, 128, bf16) == "mosaic"
  assert Config().scan_lowering(32, 128, 128, f32) == "triton"   # exact float32 products
  assert Config().scan_lowering(32, 32, 32, bf16) == "triton"    # K below one wgmma tile
  assert Config(scan_fwd_lowering="triton").scan_lowering(32, 128, 128, bf16) == "triton"
  assert Config().scan_lowering(32, 128, 128, bf16, interpret=True) == "triton"  # see scan_lowering
  assert Config(scan_fwd_lowering="mosaic").scan_lowering(32, 128, 128, bf16, interpret=True) == "mosaic"
  with pytest.raises(ValueError, match="scan_fwd_lowering='mosaic' cannot run here.*bf16"):
    Config(scan_fwd_lowering="mosaic").scan_lowering(32, 128, 128, f32)
  with pytest.raises(ValueError, match="scan_fwd_lowering must be"):
    Config(scan_fwd_lowering="cuda")
  # The backward pass: the same rules, its own setting and V block.
  backward = dict(interpret=False, backward=True)
  assert Config().scan_lowering(32, 128, 128, bf16, **backward) == "mosaic"
  assert Config().scan_lowering(32, 128, 128, f32, **backward) == "triton"
  assert Config().scan_lowering(32, 128, 128, bf16, interpret=True, backward=True) == "triton"
  assert Config(scan_bwd_lowering="triton").scan_lowering(32, 128, 128, bf16, **backward) == "triton"
  assert Config(scan_bwd_lowering="mosaic").scan_lowering(32, 128, 128, bf16, **backward) == "mosaic"
  assert Config(scan_bwd_lowering="triton").scan_lowering(32, 128, 128, bf16) == "mosaic"  # the forward's
  assert Config(scan_bwd_lowering="mosaic").scan_lowering(32, 128, 128, bf16, interpret=True) == "triton"
  with pytest.raises(ValueError, match="scan_bwd_lowering='mosaic' cannot run here.*bf16"):
    Config(scan_bwd_lowering="mosaic").scan_lowering(32, 128, 128, f32, **backward)
  with pytest.raises(ValueError, match="scan_bwd_lowering='mosaic' cannot run here.*multiple of 64"):
    Config(scan_bwd_lowering="mosaic").scan_lowering(32, 32, 32, bf16, **backward)
  with pytest.raises(ValueError, match="scan_bwd_lowering must be"):
    Config(scan_bwd_lowering="wgmma")
  # Shared memory: 3 slots of chunk 64 with forward V blocks of 64 ask for more than the H200's 227 KiB;
  # the backward pass, at its own V block of 32, still fits and is chosen on its own.
  wide = dict(mosaic_slots=3, block_v_fwd=64)
  with pytest.raises(ValueError, match="shared memory"):
    Config(**wide, scan_fwd_lowering="mosaic").scan_lowering(64, 128, 128, bf16)
  assert Config(**wide).scan_lowering(64, 128, 128, bf16) == "triton"
  assert Config(**wide).scan_lowering(64, 128, 128, bf16, backward=True) == "mosaic"
  assert Config(**wide).scan_lowering(32, 128, 128, bf16) == "mosaic"
  with pytest.raises(ValueError, match="mosaic_slots must be a positive int"):
    Config(mosaic_slots=0)


def test_bad_inputs_raise_clear_errors():
  qkvgb, S0, _ = make_inputs(0, 1, 8, 1, 4, 3)
  with pytest.raises(ValueError, match="chunk_size in"):
    chunk_kda(*qkvgb, chunk_size=48, implementation="interpret")
  big = make_inputs(0, 1, 4, 1, 264, 8)[0]
  with pytest.raises(ValueError, match="K and V up to 256"):
    chunk_kda(*big, implementation="interpret")
  wide = make_inputs(0, 1, 4, 1, 136, 8)[0]  # padded to 256 wide
  with pytest.raises(ValueError, match="at chunk_size 128 supports K and V up to 128"):
    chunk_kda(*wide, chunk_size=128, implementation="interpret")
  with pytest.raises(ValueError, match="needs a GPU"):
    chunk_kda(*qkvgb, implementation="pallas")
  with pytest.raises(ValueError, match="block_v_fwd must be a power of two"):
    Config(block_v_fwd=24)


def test_default_implementation_on_cpu_is_xla():
  qkvgb, _, _ = make_inputs(1, 1, 20, 1, 4, 4)
  o, _ = chunk_kda(*qkvgb, chunk_size=16)
  o_xla, _ = chunk_kda(*qkvgb, chunk_size=16, implementation="xla")
  np.testing.assert_array_equal(o, o_xla)


def test_launch_parameters_follow_the_chunk_unless_set():
  """Unset launch parameters take the ones measured for the chunk size; set ones are kept."""
  from pallas_kernels.kda.lowering import Tuning
  at_32, at_64 = Config().for_chunk(32), Config(prep_bwd=Tuning(8, 1)).for_chunk(64)
  assert (at_32.prep_bwd, at_32.scan_fwd, at_32.block_fwd) == (Tuning(2, 1), Tuning(4, 3), 128)
  assert (at_64.prep_bwd, at_64.scan_fwd, at_64.block_fwd) == (Tuning(8, 1), Tuning(4, 2), 32)
  assert Config(block=16).for_chunk(64).block_fwd == 16 and Config(block_fwd=16).for_chunk(32).block_fwd == 16
  # Chunk 128 runs unpipelined: deeper pipelines overflow the H200's shared memory there.
  at_128 = Config().for_chunk(128)
  assert all(getattr(at_128, n).num_stages == 1
             for n in ("prep_fwd", "state_grads", "prep_bwd", "scan_fwd", "scan_bwd"))
  assert all(getattr(Config().for_chunk(c), n) is not None for c in (16, 128)
             for n in ("prep_fwd", "state_grads", "prep_bwd", "scan_fwd", "scan_bwd"))


MERGE_CASES = {
    # Several K and V blocks per program (block 16), documents ending inside chunks and on their edges.
    "T50-C16-docs": dict(T=50, C=16, H=2, K=16, V=16, docs=[5, 11, 16, 1, 17], gate=None, dtype=jnp.float32,
                         config=Config(block=16, block_fwd=16, block_v_fwd=16)),
    # Five chunks, padded to six; widths padded (K 40 -> 64, V 24 -> 32).
    "T131-C32-padded": dict(T=131, C=32, H=1, K=40, V=24, docs=[32, 1, 40, 58], gate=None,
                            dtype=jnp.float32, config=Config(block=16, block_fwd=16)),
    # Every gate at the bound: a pair's decay e^-320 underflows to zero, as a chunk's would.
    "T64-C16-bound": dict(T=64, C=16, H=1, K=16, V=16, docs=None, gate=LB, dtype=jnp.float32,
                          config=Config(block=16, block_fwd=16)),
    # bf16 with the Mosaic state pass at the merged chunk of 64, in one pass and in two segments (whose
    # pairs of chunks are padded to whole segments).
    "T100-C32-bf16-mosaic": dict(T=100, C=32, H=1, K=64, V=64, docs=[32, 20, 48], gate=None,
                                 dtype=jnp.bfloat16,
                                 config=Config(scan_fwd_lowering="mosaic", scan_segments=1)),
    "T100-C32-bf16-mosaic-segments": dict(T=100, C=32, H=1, K=64, V=64, docs=[32, 20, 48], gate=None,
                                          dtype=jnp.bfloat16,
                                          config=Config(scan_fwd_lowering="mosaic", scan_segments=2)),
}


@pytest.mark.parametrize("name", list(MERGE_CASES))
def test_merged_chunk_pairs_give_the_same_forward(name):
  """Config.merge_chunks: the forward with each pair of chunks merged for the state pass equals the
  unmerged op and the float32 recurrence (o and the final state, initial state given); the gradient
  path, which never merges, is the unmerged one exactly."""
  import dataclasses

  c = MERGE_CASES[name]
  qkvgb, S0, cot = make_inputs(len(name), 2, c["T"], c["H"], c["K"], c["V"], dtype=c["dtype"], gate=c["gate"])
  seg = None if c["docs"] is None else jnp.asarray(np.stack([ids_from_lengths(c["docs"])] * 2), jnp.int32)
  merged_cfg = dataclasses.replace(c["config"], merge_chunks=True)
  forward = jax.jit(lambda qkvgb, cfg: run("kernel", qkvgb, S0, seg, C=c["C"], config=cfg), static_argnums=1)
  merged, plain = forward(qkvgb, merged_cfg), forward(qkvgb, c["config"])
  f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
  want = run("recurrent", f32(qkvgb), S0, seg, C=c["C"])
  bf16 = c["dtype"] == jnp.bfloat16
  for m, p, w in zip(jax.tree.leaves(merged), jax.tree.leaves(plain), jax.tree.leaves(want), strict=True):
    assert rel_err(m, p) <= (2e-3 if bf16 else 1e-6)
    assert rel_err(m, w) <= (1e-2 if bf16 else 1e-5)
    assert np.all(np.isfinite(np.asarray(m, np.float32)))
  if not bf16:
    grads = [value_and_vjp(qkvgb, S0, seg, cot, impl="kernel", C=c["C"], config=cfg)
             for cfg in (merged_cfg, c["config"])]
    for a, b in zip(*map(jax.tree.leaves, grads), strict=True):
      np.testing.assert_array_equal(a, b)


def test_merged_chunk_pairs_need_a_state_pass_at_twice_the_chunk():
  qkvgb, S0, _ = make_inputs(0, 1, 8, 1, 4, 3)
  with pytest.raises(ValueError, match="merge_chunks runs the state pass at chunk 256"):
    run("kernel", qkvgb, S0, None, C=128, config=Config(merge_chunks=True))
  with pytest.raises(ValueError, match="merge_chunks must be True or False"):
    Config(merge_chunks=1)
