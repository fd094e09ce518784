"""The Mosaic GPU ports of KDA's state scans (pallas_kernels.kda.mosaic) on the
CPU: Mosaic GPU interpret mode against float64 loops over the recurrences and against the Triton scans in
interpret mode (keep mode's states and V' too), with the interpreter's race detector watching the TMA slot
rings and the stores; their lowering for CUDA at the benchmark's shapes (lowering needs no GPU: it catches
layout, tiling and shared-memory errors before a GPU run); and benchmarks/kda_backend.py --smoke."""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.kda_backend import TITLE
from benchmarks.report import replace_section
from pallas_kernels.kda.lowering import Tuning
from pallas_kernels.kda.mosaic.scan_backward import (
  scan_backward_mosaic,
  smem_bytes_backward,
  unsupported_backward,
)
from pallas_kernels.kda.mosaic.scan_forward import (
  scan_forward_mosaic,
  scan_kernel,
  smem_bytes,
  unsupported,
)
from pallas_kernels.kda.mosaic.scan_segmented import segment_length, segmented_chunks
from pallas_kernels.kda.scan import scan_backward, scan_forward

ROOT = pathlib.Path(__file__).resolve().parents[2]

H200_SMEM = 227 * 1024  # what one CUDA block may ask for on an H100 / H200


def scan_inputs(seed, B, H, N, C, K, V, dtype):
  """Bounded inputs whose state stays of order one: W and kd small enough that S <- (sdec - kd^T W) S
  does not grow, sdec in (0.3, 1]."""
  rng = np.random.default_rng(seed)
  T = N * C
  normal = lambda scale, *shape: jnp.asarray(scale * rng.normal(size=shape), dtype)
  W, qg, kd = (normal(0.05, B, H, T, K) for _ in range(3))
  U, Aqk = normal(1.0, B, H, T, V), normal(0.1, B, H, T, C)
  sdec = jnp.asarray(rng.uniform(0.3, 1.0, size=(B, H, N, K)), jnp.float32)
  S0 = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
  return W, U, qg, kd, Aqk, sdec, S0


def recurrence(W, U, qg, kd, Aqk, sdec, S0):
  """o [B,T,H,V] and the final state, chunk by chunk in float64."""
  W, U, qg, kd, Aqk, sdec, S = (np.asarray(x, np.float64) for x in (W, U, qg, kd, Aqk, sdec, S0))
  B, H, T, _ = W.shape
  C = Aqk.shape[-1]
  o = np.zeros((B, T, H, U.shape[-1]))
  for c in range(T // C):
    rows = slice(c * C, (c + 1) * C)
    Vp = U[:, :, rows] - W[:, :, rows] @ S
    o[:, rows] = np.swapaxes(qg[:, :, rows] @ S + Aqk[:, :, rows] @ Vp, 1, 2)
    S = sdec[:, :, c, :, None] * S + np.swapaxes(kd[:, :, rows], -1, -2) @ Vp
  return o, S


def backward_inputs(seed, B, H, N, C, K, V, dtype):
  """(dO, Aqk, kd, W, qg, sdec, dSfin) for the backward scan: scan_inputs' operands, dO [B,T,H,V] of
  order one in `dtype` and a float32 cotangent of the final state."""
  W, _, qg, kd, Aqk, sdec, dSfin = scan_inputs(seed, B, H, N, C, K, V, dtype)
  dO = jnp.asarray(np.random.default_rng(seed + 1).normal(size=(B, N * C, H, V)), dtype)
  return dO, Aqk, kd, W, qg, sdec, dSfin


def recurrence_backward(dO, Aqk, kd, W, qg, sdec, dSfin):
  """dV' [B,H,T,V], the cotangent of the state leaving each chunk [B,H,N,K,V] and dS0, chunk by chunk from
  the last in float64."""
  dO, Aqk, kd, W, qg, sdec, dS = (np.asarray(x, np.float64) for x in (dO, Aqk, kd, W, qg, sdec, dSfin))
  B, H, T, K = W.shape
  C = Aqk.shape[-1]
  N = T // C
  dO = np.swapaxes(dO, 1, 2)
  tr = lambda x: np.swapaxes(x, -1, -2)
  dVp, dSn = np.zeros(dO.shape), np.zeros((B, H, N, K, dO.shape[-1]))
  for c in reversed(range(N)):
    rows = slice(c * C, (c + 1) * C)
    dSn[:, :, c] = dS
    dVp[:, :, rows] = tr(Aqk[:, :, rows]) @ dO[:, :, rows] + kd[:, :, rows] @ dS
    dS = (sdec[:, :, c, :, None] * dS + tr(qg[:, :, rows]) @ dO[:, :, rows]
          - tr(W[:, :, rows]) @ dVp[:, :, rows])
  return dVp, dSn, dS


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def smem_limit(limit):
  """Mosaic GPU's context manager that lowers its shared-memory limit for tests (a private jax API; None
  where it moved)."""
  try:
    from jax.experimental.mosaic.gpu.core import artificial_shared_memory_limit
  except ImportError:
    return None
  return artificial_shared_memory_limit(limit)


def assert_lowers_counting_smem(f, args, need: int):
  """Mosaic GPU lowers f for CUDA and counts exactly `need` bytes of shared memory: past the H200's it
  refuses with that count, else it refuses one byte short of it and lowers at the real limit."""
  lower = lambda: f.trace(*args).lower(lowering_platforms=("cuda",))
  if need > H200_SMEM:
    with pytest.raises(ValueError, match=f"shared memory: smem_bytes={need} "):
      lower()
    return
  # One byte short, before the lowering that succeeds (which a later lowering could reuse).
  if (short := smem_limit(need - 1)) is not None:
    with short, pytest.raises(ValueError, match=f"shared memory: smem_bytes={need} "):
      lower()
  assert "mosaic_gpu" in lower().as_text()


def benchmark_args(C, backward=False):
  """ShapeDtypeStructs of a scan's operands at kda_backend.py's shape (B=2 T=8192 H=16 K=V=128, bf16):
  (W, U, qg, kd, A_qk, sdec, S0) forward, (dO, A_qk, kd, W, qg, sdec, dS_fin) backward."""
  B, H, T, D = 2, 16, 8192, 128
  sd = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  bhtd, aqk = sd((B, H, T, D), bf), sd((B, H, T, C), bf)
  sdec, state = sd((B, H, T // C, D), jnp.float32), sd((B, H, D, D), jnp.float32)
  if backward:
    return sd((B, T, H, D), bf), aqk, bhtd, bhtd, bhtd, sdec, state
  return bhtd, bhtd, bhtd, bhtd, aqk, sdec, state


def races_found():
  """Whether the interpreter's race detector saw a race since the last reset (a private jax API; None
  where it moved)."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  except ImportError:
    return None
  return interpret_pallas_call.get_races().races_found


# (chunk, V width, V block, slots, input dtype): the padded chunk (32 and 16 rows fill half and a
# quarter of a wgmma tile), two stacked tiles (64), rings that wrap and one slot, several V blocks.
CASES = [(64, 64, 32, 2, jnp.float32), (32, 64, 16, 3, jnp.bfloat16), (16, 128, 64, 1, jnp.bfloat16)]


@pytest.mark.parametrize("C,V,block_v,stages,dtype", CASES)
def test_matches_the_recurrence_and_the_triton_scan(C, V, block_v, stages, dtype):
  """Against float64 within bf16 operand rounding (the port's products take bf16 operands, float32
  inputs too), and against the Triton scan with bf16 products: the same operands in the same products,
  but float32 sums added in another order, so a bf16 rounding of U - W S or of the entering state can
  land on the other neighbour. One such flip moves one column of the rows after it, by about a bf16 ulp
  of that entry (seen on one CPU: 0.3% of o off by more than float32 rounding, all in one column of the
  last chunk). No races between the chunk loads, the products and the output stores."""
  inputs = scan_inputs(0, B=1, H=2, N=5, C=C, K=64, V=V, dtype=dtype)
  o, S, states, Vp = scan_forward_mosaic(*inputs, out_dtype=jnp.float32, block_v=block_v, stages=stages,
                                         interpret=plgpu.InterpretGPUParams(detect_races=True))
  assert races_found() in (False, None)
  assert states is None and Vp is None
  o_ref, S_ref = recurrence(*inputs)
  assert o.shape == o_ref.shape and S.shape == S_ref.shape
  assert rel(o, o_ref) < 1e-2 and rel(S, S_ref) < 1e-2
  o_tr, S_tr = scan_forward(*inputs, out_dtype=jnp.float32, block_v=block_v, big="bf16", interpret=True,
                            tuning=Tuning())[:2]
  for x, x_tr in ((o, o_tr), (S, S_tr)):
    x, x_tr = np.asarray(x, np.float64), np.asarray(x_tr, np.float64)
    assert rel(x, x_tr) < 2e-4
    assert np.mean(np.abs(x - x_tr) > 1e-5 * np.abs(x_tr).max()) < 0.02


def test_bf16_output():
  inputs = scan_inputs(1, B=2, H=1, N=3, C=32, K=64, V=32, dtype=jnp.bfloat16)
  o, S = scan_forward_mosaic(*inputs, out_dtype=jnp.bfloat16, block_v=32, interpret=True)[:2]
  o_ref, S_ref = recurrence(*inputs)
  assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
  assert rel(o, o_ref) < 1e-2 and rel(S, S_ref) < 1e-2


# (chunk, V width, V block, slots, input dtype): both chunks the op runs, three and two V blocks, rings
# that wrap (5 chunks).
KEEP_CASES = [(32, 48, 16, 3, jnp.bfloat16), (64, 64, 32, 2, jnp.float32)]


@pytest.mark.parametrize("C,V,block_v,stages,dtype", KEEP_CASES)
def test_keep_mode_matches_the_triton_scan(C, V, block_v, stages, dtype):
  """states and V' are the Triton scan's: both round to bf16 the state entering the chunk and U - W S from
  the same bf16 operands, so they differ only where the two float32 sums, added in another order, round
  to neighbouring bf16 values. o and the final state are those of the run without keep mode. No races
  between the single-buffered state and V' tiles and their stores."""
  inputs = scan_inputs(2, B=1, H=2, N=5, C=C, K=64, V=V, dtype=dtype)
  o, S, states, Vp = scan_forward_mosaic(*inputs, out_dtype=jnp.float32, block_v=block_v, stages=stages,
                                         states_dtype=jnp.bfloat16,
                                         interpret=plgpu.InterpretGPUParams(detect_races=True))
  assert races_found() in (False, None)
  _, _, states_tr, Vp_tr = scan_forward(*inputs, out_dtype=jnp.float32, block_v=block_v, big="bf16",
                                        states_dtype=jnp.bfloat16, interpret=True, tuning=Tuning())
  for x, x_tr in ((states, states_tr), (Vp, Vp_tr)):
    assert x.dtype == jnp.bfloat16 and x.shape == x_tr.shape
    x, x_tr = np.asarray(x, np.float32), np.asarray(x_tr, np.float32)
    assert np.mean(x != x_tr) < 1e-3
    np.testing.assert_allclose(x, x_tr, rtol=2.0**-7, atol=0)  # one bf16 ulp
  o_plain, S_plain = scan_forward_mosaic(*inputs, out_dtype=jnp.float32, block_v=block_v, stages=stages,
                                         interpret=True)[:2]
  np.testing.assert_array_equal(o, o_plain)
  np.testing.assert_array_equal(S, S_plain)


def test_keep_mode_is_bf16_only():
  inputs = scan_inputs(0, B=1, H=1, N=2, C=32, K=64, V=32, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="states_dtype"):
    scan_forward_mosaic(*inputs, out_dtype=jnp.bfloat16, block_v=32, states_dtype=jnp.float32, interpret=True)


def test_needs_a_slot():
  inputs = scan_inputs(0, B=1, H=1, N=2, C=32, K=64, V=32, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="stages must be >= 1"):
    scan_forward_mosaic(*inputs, out_dtype=jnp.bfloat16, block_v=32, stages=0, interpret=True)


# (segments, chunks, chunk, V width, V block, slots, input dtype): two segments of two chunks, three of
# one (fewer chunks than slots), four of two with several V blocks per segment and two per K; uneven:
# 4 + 1 chunks (the last segment has fewer than the slots), 3 + 3 + 2 at one slot.
SEGMENT_CASES = [(2, 4, 32, 64, 32, 2, jnp.bfloat16), (3, 3, 16, 32, 32, 2, jnp.float32),
                 (4, 8, 32, 64, 16, 3, jnp.bfloat16), (2, 5, 32, 64, 32, 2, jnp.bfloat16),
                 (3, 8, 32, 64, 32, 1, jnp.float32)]


@pytest.mark.parametrize("P,N,C,V,block_v,stages,dtype", SEGMENT_CASES)
def test_segments_match_the_recurrence_and_the_whole_pass(P, N, C, V, block_v, stages, dtype):
  """The chunks walked in P segments at once, the later ones corrected by their entering states
  (mosaic.scan_segmented), against float64 and against one pass over all of them: within bf16 operand
  rounding, with states that carry over many chunks (decays in (0.3, 1]) and an initial state. No races
  in the kernel, whose homogeneous programs store to their own output."""
  inputs = scan_inputs(4, B=2, H=2, N=N, C=C, K=64, V=V, dtype=dtype)
  o, S, states, Vp = scan_forward_mosaic(*inputs, out_dtype=jnp.float32, block_v=block_v, stages=stages,
                                         segments=P, interpret=plgpu.InterpretGPUParams(detect_races=True))
  assert races_found() in (False, None)
  assert states is None and Vp is None
  o_ref, S_ref = recurrence(*inputs)
  assert o.shape == o_ref.shape and S.shape == S_ref.shape
  assert rel(o, o_ref) < 1e-2 and rel(S, S_ref) < 1e-2
  o_one, S_one = scan_forward_mosaic(*inputs, out_dtype=jnp.float32, block_v=block_v, stages=stages,
                                     interpret=True)[:2]
  # Segment 0 walks as the whole pass does, from the same state: the same products in the same order.
  first = segment_length(N, P, C) * C
  np.testing.assert_array_equal(o[:, :first], o_one[:, :first])
  assert rel(o, o_one) < 5e-3 and rel(S, S_one) < 5e-3


def test_segments_refuse_what_they_cannot_split():
  inputs = scan_inputs(0, B=1, H=1, N=3, C=32, K=64, V=32, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="keeps no states"):
    scan_forward_mosaic(*inputs, out_dtype=jnp.bfloat16, block_v=32, states_dtype=jnp.bfloat16, segments=3,
                        interpret=True)
  with pytest.raises(ValueError, match="a chunk in every segment"):
    scan_forward_mosaic(*inputs, out_dtype=jnp.bfloat16, block_v=32, segments=4, interpret=True)
  with pytest.raises(ValueError, match="segments must be an int >= 2"):
    scan_forward_mosaic(*inputs, out_dtype=jnp.bfloat16, block_v=32, segments=0, interpret=True)


def test_segment_lengths():
  """Segments 0..P-2 get Ns chunks and the last one the rest, from 1 to Ns; Ns is N / P rounded up, to an
  even count at chunk 32 (whole 64-row blocks) where the last segment keeps a chunk. segmented_chunks pads
  a row that no Ns can split to P Ns' chunks."""
  for N in range(1, 70):
    for P in range(2, 9):
      for C in (16, 32, 64):
        Ns = segment_length(N, P, C)
        if Ns is None:
          assert (P - 1) * -(-N // P) >= N
          padded = segmented_chunks(N, P, C)
          assert padded == P * -(-N // P) and segment_length(padded, P, C) is not None
          continue
        assert segmented_chunks(N, P, C) == N
        assert 1 <= N - (P - 1) * Ns <= Ns
        up = -(-N // P)
        per_block = max(1, 64 // C)
        rounded = -(-up // per_block) * per_block
        assert Ns == (rounded if (P - 1) * rounded < N else up)
  assert segment_length(4096, 3, 32) == 1366 and segment_length(4096, 2, 32) == 2048


@pytest.mark.parametrize("segments,stages,block_v", [(2, 2, 32), (4, 2, 32), (3, 1, 32), (4, 1, 64)])
def test_segments_lower_for_cuda_at_a_long_row(segments, stages, block_v):
  """B=1 T=32768 H=16 K=V=128, the shape segments are for: Mosaic GPU lowers the kernel with its
  homogeneous programs and counts the shared memory of the unsegmented pass; three segments (342, 342
  and 340 chunks) with the last one's trip count traced; four of 64 columns at one slot, the op's
  default at this shape. (The Triton kernel that then corrects the outputs lowers only where a GPU is,
  so the kernel is lowered alone.)"""
  bf = jnp.bfloat16
  sd = jax.ShapeDtypeStruct
  B, H, T, D, C = 1, 16, 32768, 128, 32
  bhtd = sd((B, H, T, D), bf)
  args = (bhtd, bhtd, bhtd, bhtd, sd((B, H, T, C), bf), sd((B, H, T // C, D), jnp.float32),
          sd((B * segments, H, D, 2 * D), jnp.float32))
  f = jax.jit(lambda *a: scan_kernel(*a, out_dtype=bf, block_v=block_v, stages=stages, segments=segments))
  assert_lowers_counting_smem(f, args, smem_bytes(128, C, block_v, stages, bf))


@pytest.mark.parametrize("K,C,block_v,V",
                         [(96, 32, 16, 64), (64, 24, 16, 64), (64, 32, 8, 64), (64, 32, 32, 48)])
def test_rejects_shapes_it_cannot_tile(K, C, block_v, V):
  inputs = scan_inputs(0, B=1, H=1, N=2, C=C, K=K, V=V, dtype=jnp.bfloat16)
  with pytest.raises(ValueError):
    scan_forward_mosaic(*inputs, out_dtype=jnp.bfloat16, block_v=block_v, interpret=True)


@pytest.mark.parametrize("stages,keep", [(2, False), (3, False), (2, True)])
@pytest.mark.parametrize("block_v", [16, 32, 64])
@pytest.mark.parametrize("C", [32, 64])
def test_lowers_for_cuda_at_the_benchmark_shapes(C, block_v, stages, keep):
  """B=2 T=8192 H=16 K=V=128 as benchmarks/kda_backend.py runs it, and with keep mode as training runs it:
  Mosaic GPU lowers the kernel (what the GPU adds is ptxas) and counts the shared memory smem_bytes
  predicts, to the byte, so it refuses exactly the settings smem_bytes puts past the H200's."""
  bf = jnp.bfloat16
  states_dtype = bf if keep else None
  f = jax.jit(lambda *a: scan_forward_mosaic(*a, out_dtype=bf, block_v=block_v, stages=stages,
                                             states_dtype=states_dtype))
  assert_lowers_counting_smem(f, benchmark_args(C), smem_bytes(128, C, block_v, stages, bf))


@pytest.mark.parametrize("K,C,block_v,store_dtype,stages,why", [
    (128, 32, 32, jnp.bfloat16, 2, None), (128, 64, 64, jnp.bfloat16, 2, None),
    (128, 32, 32, jnp.float32, 2, "bf16"), (96, 32, 32, jnp.bfloat16, 2, "multiple of 64"),
    (128, 64, 64, jnp.bfloat16, 3, "shared memory"), (128, 128, 32, jnp.bfloat16, 2, "shared memory")])
def test_unsupported(K, C, block_v, store_dtype, stages, why):
  got = unsupported(K, C, block_v, 128, store_dtype, stages)
  assert got is None if why is None else why in got


# (chunk, V width, V block, slots, chunks, input dtype): the padded chunk (32 and 16 rows fill half and
# a quarter of a wgmma tile, and A_qk arrives in 8-row bands), an unpadded one, rings that wrap, one slot,
# more slots than chunks, several V blocks.
BWD_CASES = [(32, 64, 16, 3, 5, jnp.bfloat16), (64, 64, 32, 2, 5, jnp.float32),
             (16, 32, 16, 1, 5, jnp.bfloat16), (32, 32, 32, 4, 2, jnp.bfloat16)]


@pytest.mark.parametrize("C,V,block_v,stages,N,dtype", BWD_CASES)
def test_backward_matches_the_recurrence_and_the_triton_scan(C, V, block_v, stages, N, dtype):
  """Against float64 within bf16 rounding (bf16 operands and stores), and against the Triton scan with
  bf16 products: both round dS and dV' to bf16 for the products and the stores alike, so most stored
  values agree bit for bit; where the two float32 sums, added in another order, round a dV' to the
  neighbouring bf16 value, the next chunks' dS differ a little, hence norms rather than ulps. No races
  between the chunk loads, the products and the stores from the single-buffered dS and dV' tiles."""
  inputs = backward_inputs(3, B=1, H=2, N=N, C=C, K=64, V=V, dtype=dtype)
  out = scan_backward_mosaic(*inputs, store_dtype=jnp.bfloat16, block_v=block_v, stages=stages,
                             interpret=plgpu.InterpretGPUParams(detect_races=True))
  assert races_found() in (False, None)
  refs = recurrence_backward(*inputs)
  triton = scan_backward(*inputs, store_dtype=jnp.bfloat16, block_v=block_v, big="bf16", interpret=True,
                         tuning=Tuning())
  for x, x_ref, x_tr, dtype_out in zip(out, refs, triton, (jnp.bfloat16, jnp.bfloat16, jnp.float32),
                                       strict=True):
    assert x.dtype == dtype_out and x.shape == x_ref.shape == x_tr.shape
    assert rel(x, x_ref) < 1e-2
    assert rel(x, x_tr) < 1e-3
  for x, x_tr in zip(out[:2], triton[:2], strict=True):
    assert np.mean(np.asarray(x, np.float32) != np.asarray(x_tr, np.float32)) < 1e-2


def test_backward_stores_bf16_only():
  inputs = backward_inputs(0, B=1, H=1, N=2, C=32, K=64, V=32, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="store_dtype"):
    scan_backward_mosaic(*inputs, store_dtype=jnp.float32, block_v=32, interpret=True)


@pytest.mark.parametrize("K,C,block_v,V",
                         [(96, 32, 16, 64), (64, 24, 16, 64), (64, 32, 8, 64), (64, 32, 32, 48)])
def test_backward_rejects_shapes_it_cannot_tile(K, C, block_v, V):
  inputs = backward_inputs(0, B=1, H=1, N=2, C=C, K=K, V=V, dtype=jnp.bfloat16)
  with pytest.raises(ValueError):
    scan_backward_mosaic(*inputs, store_dtype=jnp.bfloat16, block_v=block_v, interpret=True)


@pytest.mark.parametrize("block_v", [16, 32, 64])
@pytest.mark.parametrize("C", [32, 64])
def test_backward_lowers_for_cuda_at_the_benchmark_shapes(C, block_v):
  """B=2 T=8192 H=16 K=V=128 as benchmarks/kda_backend.py and training run it, two slots: Mosaic GPU lowers
  the kernel and counts the shared memory smem_bytes_backward predicts, to the byte."""
  f = jax.jit(lambda *a: scan_backward_mosaic(*a, store_dtype=jnp.bfloat16, block_v=block_v, stages=2))
  need = smem_bytes_backward(128, C, block_v, 2)
  assert need <= H200_SMEM
  assert_lowers_counting_smem(f, benchmark_args(C, backward=True), need)


@pytest.mark.parametrize("K,C,block_v,store_dtype,stages,why", [
    (128, 32, 32, jnp.bfloat16, 2, None), (128, 64, 64, jnp.bfloat16, 3, None),
    (128, 32, 32, jnp.float32, 2, "bf16"), (96, 32, 32, jnp.bfloat16, 2, "multiple of 64"),
    (128, 64, 128, jnp.bfloat16, 3, "shared memory"), (128, 128, 32, jnp.bfloat16, 2, "shared memory")])
def test_unsupported_backward(K, C, block_v, store_dtype, stages, why):
  got = unsupported_backward(K, C, block_v, 128, store_dtype, stages)
  assert got is None if why is None else why in got


def test_backend_benchmark_smoke():
  """`kda_backend.py --smoke` on the CPU: every row runs (interpret mode, both lowerings, both passes,
  no times) and the Mosaic rows agree with the Triton rows."""
  cmd = [sys.executable, "-m", "benchmarks.kda_backend", "--smoke", "--chunks", "32", "64",
         "--block-v", "16", "32", "--stages", "2"]
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "failed" not in out.stdout, out.stdout
  table = out.stdout[out.stdout.index("| pass |"):]
  rows = [line.split(" | ") for line in table.splitlines() if line.startswith(("| forward", "| backward"))]
  assert len(rows) == 16, table
  assert sorted((cells[0], cells[1]) for cells in rows) == sorted(
      (p, backend) for p in ("| forward", "| backward")
      for backend in ("Triton", "Mosaic GPU") * 4)
  for cells in rows:
    assert float(cells[-1].rstrip(" |")) < 1e-2, cells  # against the float32 recurrence
    if cells[1] == "Mosaic GPU":
      assert float(cells[-2]) < 1e-3, cells  # against Triton


def test_benchmark_section_is_replaced_in_place(tmp_path):
  """--out writes a ### section: appended once, then replaced up to the next heading of level 2 or 3."""
  path = tmp_path / "B.md"
  path.write_text("# Benchmarks\n\n## KDA kernel\n\nk\n")
  replace_section(str(path), TITLE, "old", level=3)
  assert path.read_text() == f"# Benchmarks\n\n## KDA kernel\n\nk\n\n### {TITLE}\n\nold\n"
  path.write_text(path.read_text() + "\n### Next\n\nn\n")
  replace_section(str(path), TITLE, "new", level=3)
  assert path.read_text() == f"# Benchmarks\n\n## KDA kernel\n\nk\n\n### {TITLE}\n\nnew\n\n### Next\n\nn\n"
  path.write_text(path.read_text() + "\n## Other\n\no\n")
  replace_section(str(path), TITLE, "newer", level=3)
  assert path.read_text().endswith(f"### {TITLE}\n\nnewer\n\n### Next\n\nn\n\n## Other\n\no\n")
