"""The look-ahead forms of KDA's Mosaic GPU state passes (pallas_kernels.kda.mosaic_scan_ahead and
mosaic_scan_bwd_ahead) on the CPU: interpret mode against the float64 recurrences, the two-trip Mosaic
forms and the Triton scans, with the race detector watching their slot rings (two chunks in use at once)
and their stores; the forward's keep mode; their limits; and their lowering for CUDA with the shared
memory smem_bytes_ahead / smem_bytes_backward_ahead predict."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from test_kda_mosaic_scan import (
  H200_SMEM,
  assert_lowers_counting_smem,
  backward_inputs,
  benchmark_args,
  races_found,
  recurrence,
  recurrence_backward,
  rel,
  scan_inputs,
)

from pallas_kernels.kda.mosaic_scan import scan_forward_mosaic
from pallas_kernels.kda.mosaic_scan_ahead import (
  ahead_products,
  scan_forward_mosaic_ahead,
  smem_bytes_ahead,
  unsupported_ahead,
)
from pallas_kernels.kda.mosaic_scan_bwd import scan_backward_mosaic
from pallas_kernels.kda.mosaic_scan_bwd_ahead import (
  ahead_products_backward,
  scan_backward_mosaic_ahead,
  smem_bytes_backward_ahead,
  unsupported_backward_ahead,
)
from pallas_kernels.kda.pallas_backend import Tuning
from pallas_kernels.kda.pallas_scan import scan_backward, scan_forward

# (chunk, V width, V block, slots, chunks, input dtype): the padded chunk (32 and 16 rows of a 64-row
# wgmma tile), the unpadded 64, the smallest ring (2 slots: each step waits for the chunk it refilled),
# rings that wrap, more slots than chunks, a single chunk (no look-ahead step at all).
CASES = [(32, 64, 16, 3, 5, jnp.bfloat16), (64, 64, 32, 2, 5, jnp.float32), (16, 128, 64, 2, 5, jnp.bfloat16),
         (32, 32, 32, 4, 2, jnp.bfloat16), (32, 32, 32, 3, 1, jnp.bfloat16)]


@pytest.mark.parametrize("C,V,block_v,stages,N,dtype", CASES)
def test_matches_the_recurrence_and_the_two_trip_form(C, V, block_v, stages, N, dtype):
  """Against float64 within bf16 operand rounding, as the two-trip form is held; against that form and the
  Triton scan within the difference of their roundings (bf16 D S, V' and M in place of bf16 S_{c+1}).
  No races in the ring, whose slots serve two chunks at once, or between the tiles and their stores."""
  inputs = scan_inputs(4, B=1, H=2, N=N, C=C, K=64, V=V, dtype=dtype)
  o, S, states, Vp = scan_forward_mosaic_ahead(*inputs, out_dtype=jnp.float32, block_v=block_v,
                                               stages=stages,
                                               interpret=plgpu.InterpretGPUParams(detect_races=True))
  assert races_found() in (False, None)
  assert states is None and Vp is None
  o_ref, S_ref = recurrence(*inputs)
  assert o.shape == o_ref.shape and S.shape == S_ref.shape
  assert rel(o, o_ref) < 1e-2 and rel(S, S_ref) < 1e-2
  o_two, S_two = scan_forward_mosaic(*inputs, out_dtype=jnp.float32, block_v=block_v, stages=2,
                                     interpret=True)[:2]
  o_tr, S_tr = scan_forward(*inputs, out_dtype=jnp.float32, block_v=block_v, big="bf16", interpret=True,
                            tuning=Tuning())[:2]
  for x, ys in ((o, (o_two, o_tr)), (S, (S_two, S_tr))):
    for y in ys:
      assert rel(x, y) < 5e-3
  if N == 1:  # no look-ahead: the two forms do the same arithmetic
    np.testing.assert_array_equal(o, o_two)


def test_look_ahead_products():
  """M's chunk n is W_n kd_{n-1}^T (bf16 operands, float32 sums, bf16 out); chunk 0's is zero."""
  rng = np.random.default_rng(5)
  W, kd = (jnp.asarray(rng.normal(size=(1, 2, 3 * 16, 64)), jnp.bfloat16) for _ in range(2))
  M = ahead_products(W, kd, 16)
  assert M.dtype == jnp.bfloat16 and M.shape == (1, 2, 48, 16)
  M = np.asarray(M, np.float64).reshape(1, 2, 3, 16, 16)
  W64, kd64 = (np.asarray(x, np.float64).reshape(1, 2, 3, 16, 64) for x in (W, kd))
  assert not M[:, :, 0].any()
  want = W64[:, :, 1:] @ np.swapaxes(kd64[:, :, :-1], -1, -2)
  np.testing.assert_allclose(M[:, :, 1:], want, rtol=2.0**-8, atol=1e-6)


@pytest.mark.parametrize("C,V,block_v,stages", [(32, 48, 16, 3), (64, 64, 32, 2)])
def test_keep_mode(C, V, block_v, stages):
  """The states entering each chunk and V' are the two-trip form's within their rounding (chunk 0's
  state bit for bit); o and the final state are the run's without keep mode, bit for bit. No races
  between the state and V' tiles, which the next step overwrites, and their stores."""
  inputs = scan_inputs(6, B=1, H=2, N=5, C=C, K=64, V=V, dtype=jnp.bfloat16)
  o, S, states, Vp = scan_forward_mosaic_ahead(*inputs, out_dtype=jnp.float32, block_v=block_v,
                                               stages=stages, states_dtype=jnp.bfloat16,
                                               interpret=plgpu.InterpretGPUParams(detect_races=True))
  assert races_found() in (False, None)
  _, _, states_two, Vp_two = scan_forward_mosaic(*inputs, out_dtype=jnp.float32, block_v=block_v, stages=2,
                                                 states_dtype=jnp.bfloat16, interpret=True)
  for x, x_two in ((states, states_two), (Vp, Vp_two)):
    assert x.dtype == jnp.bfloat16 and x.shape == x_two.shape
    assert rel(x, x_two) < 5e-3
  np.testing.assert_array_equal(states[:, :, 0], states_two[:, :, 0])
  o_plain, S_plain = scan_forward_mosaic_ahead(*inputs, out_dtype=jnp.float32, block_v=block_v,
                                               stages=stages, interpret=True)[:2]
  np.testing.assert_array_equal(o, o_plain)
  np.testing.assert_array_equal(S, S_plain)


def test_rejects_what_it_cannot_run():
  inputs = scan_inputs(0, B=1, H=1, N=3, C=32, K=64, V=32, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="stages must be >= 2"):
    scan_forward_mosaic_ahead(*inputs, out_dtype=jnp.bfloat16, block_v=32, stages=1, interpret=True)
  with pytest.raises(ValueError, match="states_dtype"):
    scan_forward_mosaic_ahead(*inputs, out_dtype=jnp.bfloat16, block_v=32, states_dtype=jnp.float32,
                              interpret=True)
  with pytest.raises(ValueError, match="multiple of 64"):
    scan_forward_mosaic_ahead(*scan_inputs(0, B=1, H=1, N=2, C=32, K=96, V=32, dtype=jnp.bfloat16),
                              out_dtype=jnp.bfloat16, block_v=32, interpret=True)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("block_v", [32, 64])
@pytest.mark.parametrize("C", [32, 64])
def test_lowers_for_cuda_at_the_benchmark_shapes(C, block_v, keep):
  """B=2 T=8192 H=16 K=V=128 at the op's 3 slots: Mosaic GPU lowers the kernel and counts the shared
  memory smem_bytes_ahead predicts, to the byte (and refuses the settings it puts past the H200's)."""
  bf = jnp.bfloat16
  f = jax.jit(lambda *a: scan_forward_mosaic_ahead(*a, out_dtype=bf, block_v=block_v, stages=3,
                                                   states_dtype=bf if keep else None))
  assert_lowers_counting_smem(f, benchmark_args(C), smem_bytes_ahead(128, C, block_v, 3, bf))


@pytest.mark.parametrize("K,C,block_v,store_dtype,stages,why", [
    (128, 32, 32, jnp.bfloat16, 3, None), (128, 64, 32, jnp.bfloat16, 2, None),
    (128, 32, 32, jnp.bfloat16, 1, "at least 2 slots"), (128, 32, 32, jnp.float32, 3, "bf16"),
    (96, 32, 32, jnp.bfloat16, 3, "multiple of 64"), (128, 64, 32, jnp.bfloat16, 3, "shared memory")])
def test_unsupported(K, C, block_v, store_dtype, stages, why):
  got = unsupported_ahead(K, C, block_v, 128, store_dtype, stages)
  assert got is None if why is None else why in got
  if why == "shared memory":
    assert smem_bytes_ahead(K, C, block_v, stages, jnp.float32) > H200_SMEM


@pytest.mark.parametrize("C,V,block_v,stages,N,dtype", CASES)
def test_backward_matches_the_recurrence_and_the_two_trip_form(C, V, block_v, stages, N, dtype):
  """dV', the dS entering each chunk's update and dS0 against float64 within bf16 rounding, and against
  the two-trip Mosaic form and the Triton scan within the difference of their roundings (bf16 D dS, -dV'
  and P, Q in place of bf16 dS_{c-1}). No races in the ring or between the tiles and their stores."""
  inputs = backward_inputs(7, B=1, H=2, N=N, C=C, K=64, V=V, dtype=dtype)
  out = scan_backward_mosaic_ahead(*inputs, store_dtype=jnp.bfloat16, block_v=block_v, stages=stages,
                                   interpret=plgpu.InterpretGPUParams(detect_races=True))
  assert races_found() in (False, None)
  refs = recurrence_backward(*inputs)
  two = scan_backward_mosaic(*inputs, store_dtype=jnp.bfloat16, block_v=block_v, stages=2, interpret=True)
  triton = scan_backward(*inputs, store_dtype=jnp.bfloat16, block_v=block_v, big="bf16", interpret=True,
                         tuning=Tuning())
  dtypes = (jnp.bfloat16, jnp.bfloat16, jnp.float32)
  for x, x_ref, x_two, x_tr, dtype_out in zip(out, refs, two, triton, dtypes, strict=True):
    assert x.dtype == dtype_out and x.shape == x_ref.shape == x_two.shape
    assert rel(x, x_ref) < 1e-2
    assert rel(x, x_two) < 5e-3 and rel(x, x_tr) < 5e-3
    if N == 1:  # no look-ahead: the two forms do the same arithmetic
      np.testing.assert_array_equal(x, x_two)


def test_look_ahead_products_backward():
  """P's chunk n is kd_{n-1} qg_n^T and Q's kd_{n-1} W_n^T (bf16 operands, float32 sums); chunk 0's zero."""
  rng = np.random.default_rng(8)
  kd, qg, W = (jnp.asarray(rng.normal(size=(1, 2, 3 * 16, 64)), jnp.bfloat16) for _ in range(3))
  P, Q = ahead_products_backward(kd, qg, W, 16)
  kd64, qg64, W64 = (np.asarray(x, np.float64).reshape(1, 2, 3, 16, 64) for x in (kd, qg, W))
  for got, x64 in ((P, qg64), (Q, W64)):
    assert got.dtype == jnp.bfloat16 and got.shape == (1, 2, 48, 16)
    got = np.asarray(got, np.float64).reshape(1, 2, 3, 16, 16)
    assert not got[:, :, 0].any()
    want = kd64[:, :, :-1] @ np.swapaxes(x64[:, :, 1:], -1, -2)
    np.testing.assert_allclose(got[:, :, 1:], want, rtol=2.0**-8, atol=1e-6)


def test_backward_rejects_what_it_cannot_run():
  inputs = backward_inputs(0, B=1, H=1, N=3, C=32, K=64, V=32, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="stages must be >= 2"):
    scan_backward_mosaic_ahead(*inputs, store_dtype=jnp.bfloat16, block_v=32, stages=1, interpret=True)
  with pytest.raises(ValueError, match="store_dtype"):
    scan_backward_mosaic_ahead(*inputs, store_dtype=jnp.float32, block_v=32, interpret=True)


@pytest.mark.parametrize("block_v", [32, 64])
@pytest.mark.parametrize("C", [32, 64])
def test_backward_lowers_for_cuda_at_the_benchmark_shapes(C, block_v):
  """B=2 T=8192 H=16 K=V=128 at 3 slots: lowered for CUDA with the shared memory predicted to the byte."""
  f = jax.jit(lambda *a: scan_backward_mosaic_ahead(*a, store_dtype=jnp.bfloat16, block_v=block_v, stages=3))
  need = smem_bytes_backward_ahead(128, C, block_v, 3)
  assert_lowers_counting_smem(f, benchmark_args(C, backward=True), need)


@pytest.mark.parametrize("K,C,block_v,store_dtype,stages,why", [
    (128, 32, 32, jnp.bfloat16, 3, None), (128, 64, 32, jnp.bfloat16, 2, None),
    (128, 32, 32, jnp.bfloat16, 1, "at least 2 slots"), (128, 32, 32, jnp.float32, 3, "bf16"),
    (96, 32, 32, jnp.bfloat16, 3, "multiple of 64"), (128, 64, 64, jnp.bfloat16, 3, "shared memory")])
def test_unsupported_backward(K, C, block_v, store_dtype, stages, why):
  got = unsupported_backward_ahead(K, C, block_v, 128, store_dtype, stages)
  assert got is None if why is None else why in got
  if why == "shared memory":
    assert smem_bytes_backward_ahead(K, C, block_v, stages) > H200_SMEM
