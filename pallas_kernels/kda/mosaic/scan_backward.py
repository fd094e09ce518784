"""The backward inter-chunk state pass of KDA (scan.scan_backward) on the Mosaic GPU lowering; the
forward is in scan_forward.py, the shared helpers and the limits in common.py. The op runs it where it
applies (config.Config.scan_lowering), where it measured faster than the Triton version
(BENCHMARKS.md, "Pallas backend: Triton vs Mosaic GPU"; benchmarks/kda_backend.py).

Backward (scan_backward_mosaic). Same grid; each program walks the chunks from the last with the [K, BV]
float32 cotangent dS of the state leaving the chunk:
  dV' = A_qk^T dO + kd dS,  dS <- sdec * dS + qg^T dO - W^T dV',
and stores, like the Triton version, the dS that enters each chunk's update, dV', and the last dS as dS0.
- The same bf16 wgmmas with one swizzle. qg^T dO and W^T dV' have the state's K rows; they read qg and W
  transposed from their [C, K] tiles, which wgmma can do for bf16. A_qk^T dO and kd dS have C rows and
  sum in one [X, BV] accumulator, which at C = 32 is half empty: the forward's stacking needs one B
  operand for both halves, and no other product of the chunk multiplies dO or dS with C rows (the next
  chunk's need this chunk's dS; stacking A_qk^T and kd along the contraction would need a tile transposed
  in one half only). The empty rows cost tensor-core throughput, not latency, and the scan is
  latency-bound (about one program per SM at the op's shapes). kd fills rows [0, C) of its tile; A_qk,
  whose transpose is the A operand, fills columns [0, C) of a [C, X] tile, by C/8 TMA copies when C < X:
  those columns are contiguous only within one 8-row band of the tiling, and TMA writes contiguous shared
  memory only. The rows past C of dV' are garbage that no product reads and no store writes out.
- wgmma only adds, W and qg arrive by TMA and dV' must be stored as it is, so the minus sign goes into a
  second bf16 copy of dV': -dV' is the B operand of W^T (-dV') (rounding commutes with negation, so this
  is W^T dV' negated exactly) and dV' the source of its store. qg^T dO and W^T (-dV') accumulate into one
  [K, BV] accumulator, and sdec * dS is added when it is read, as in the forward.
- Within a chunk: A_qk^T dO, which needs no dS, runs while dS goes to its bf16 tile; kd dS and qg^T dO
  follow, and dV' is read once all but the newest wgmma are done, so qg^T dO overlaps the conversion of
  dV'. What one chunk waits for: dS -> bf16 tile -> kd dS -> dV' -> bf16 tile -> W^T (-dV') -> dS.
- The slots fill in reverse: chunk N-1-s into slot s, then chunk c - stages into the slot chunk c frees.
  dS and dV' leave by TMA from single-buffered tiles, as in keep mode; dS0 goes from registers.
- Both stores are bf16 copies the products read anyway (hence store_dtype bf16 only), so with the Triton
  version's "bf16" precision they equal its stores up to float32 summation order.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic.common import (
  check_scan,
  launch,
  load_decay,
  scale_rows,
  shape_or_memory,
  smem_buffer,
  smem_transforms,
  tile_rows,
)


def aqk_bands(C: int) -> int:
  """TMA copies that bring A_qk's columns [0, C) into its [C, X] tile: they are contiguous only within one
  8-row band of the tiling when C < X, and TMA writes contiguous shared memory only."""
  return 1 if tile_rows(C)[2] == C else C // 8


def backward_copies(C: int) -> int:
  """The TMA copies of one chunk in fetch_backward."""
  return 5 + aqk_bands(C)


def fetch_backward(src, dst, *, b, h, c, cols, C: int, bar):
  """Copies chunk c's backward operands src = (W, qg, kd, A_qk, dO, sdec) in global memory into one
  slot's tiles dst = (W, qg, kd, A_qk, dO, sdec): kd in rows [0, C) of its tile, A_qk in columns [0, C)
  by aqk_bands(C) copies. backward_copies(C) copies, all counted on `bar`."""
  W_g, qg_g, kd_g, Aqk_g, dO_g, sdec_g = src
  W_s, qg_s, kd_s, Aqk_s, dO_s, sdec_s = dst
  rows = pl.ds(c * C, C)
  plgpu.copy_gmem_to_smem(W_g.at[b, h, rows], W_s, bar)
  plgpu.copy_gmem_to_smem(qg_g.at[b, h, rows], qg_s, bar)
  plgpu.copy_gmem_to_smem(kd_g.at[b, h, rows], kd_s.at[pl.ds(0, C)], bar)
  band = C // aqk_bands(C)
  for r in range(0, C, band):
    plgpu.copy_gmem_to_smem(Aqk_g.at[b, h, pl.ds(c * C + r, band)], Aqk_s.at[pl.ds(r, band), pl.ds(0, C)],
                            bar)
  plgpu.copy_gmem_to_smem(dO_g.at[b, rows, h, cols], dO_s, bar)
  plgpu.copy_gmem_to_smem(sdec_g.at[b, h, c], sdec_s, bar)


def backward_ring(stages: int, C: int, K: int, block_v: int) -> list:
  """The `stages` chunk slots that fetch_backward fills, in its dst order (W, qg, kd, A_qk, dO, sdec),
  as the backward pass's scratch."""
  X = tile_rows(C)[2]
  bf = jnp.bfloat16
  mma = functools.partial(smem_transforms, bf, max_elems=min(block_v, C))  # one swizzle, as in the forward
  return [
      plgpu.SMEM((stages, C, K), bf, transforms=mma(K)),       # W
      plgpu.SMEM((stages, C, K), bf, transforms=mma(K)),       # qg
      plgpu.SMEM((stages, X, K), bf, transforms=mma(K)),       # kd, rows [0, C)
      plgpu.SMEM((stages, C, X), bf, transforms=mma(X)),       # A_qk, columns [0, C)
      plgpu.SMEM((stages, C, block_v), bf, transforms=mma(block_v)),  # dO
      plgpu.SMEM((stages, K), jnp.float32),                    # sdec
  ]


def smem_bytes_backward(K: int, C: int, block_v: int, stages: int) -> int:
  """Shared memory of one scan_backward_mosaic program, to the byte as Mosaic GPU counts it against the
  limit: `stages` chunk slots (W, qg, kd, A_qk, dO, sdec), the bf16 tiles of dS, -dV' and dV' (each buffer
  rounded up to the 1 KiB Mosaic aligns scratch to) and one 8-byte barrier per slot."""
  X = tile_rows(C)[2]
  size, bf = smem_buffer, jnp.bfloat16
  buffers = (size(bf, stages, C, K), size(bf, stages, C, K), size(bf, stages, X, K), size(bf, stages, C, X),
             size(bf, stages, C, block_v), size(jnp.float32, stages, K), size(bf, K, block_v),
             size(bf, X, block_v), size(bf, X, block_v))
  return sum(buffers) + 8 * stages


def unsupported_backward(K: int, C: int, block_v: int, V: int, store_dtype, stages: int) -> str | None:
  """Why scan_backward_mosaic cannot take these settings where the op stores its intermediates (dV' and the
  per-chunk dS) in store_dtype; None when it can."""
  if jnp.dtype(store_dtype) != jnp.bfloat16:
    return f"the Mosaic backward scan takes bf16 operands and stores bf16, not {jnp.dtype(store_dtype).name}"
  return shape_or_memory(K, C, block_v, V, stages, lambda: smem_bytes_backward(K, C, block_v, stages))


def scan_backward_mosaic(dO, Aqk, kd, W, qg, sdec, dSfin, *, store_dtype, block_v: int, stages: int = 2,
                         interpret=False):
  """Returns (dV', dS_next, dS0) like scan.scan_backward with big="bf16": dV' [B,H,T,V] and the
  cotangent of the state leaving each chunk [B,H,N,K,V] (the dS that enters the chunk's update), both in
  store_dtype, and the cotangent of the initial state [B,H,K,V] float32. dO is [B,T,H,V], like o; dSfin
  [B,H,K,V] is the cotangent of the final state. store_dtype must be bf16 (ValueError otherwise): the
  stores reuse the bf16 tiles the products read. stages: chunk slots in flight. interpret: True (or
  plgpu.InterpretGPUParams) runs the kernel in Mosaic GPU interpret mode on the CPU."""
  B, H, T, K = W.shape
  V = dO.shape[-1]
  C = Aqk.shape[-1]
  N = T // C
  BV = block_v
  check_scan(K, C, BV, V, T, stages, bf16_stores=(("store_dtype", store_dtype),))
  stages = min(stages, N)
  X = tile_rows(C)[2]
  bf, f32 = jnp.bfloat16, jnp.float32
  dO, Aqk, kd, W, qg = (x.astype(bf) for x in (dO, Aqk, kd, W, qg))
  sdec, dSfin = sdec.astype(f32), dSfin.astype(f32)
  mma = functools.partial(smem_transforms, bf, max_elems=min(BV, C))  # one swizzle, as in the forward

  def body(dO_g, Aqk_g, kd_g, W_g, qg_g, sdec_g, dSfin_g, dVp_g, dSn_g, dS0_g,
           W_s, qg_s, kd_s, Aqk_s, dO_s, sdec_s, S_s, Vn_s, Vp_s, loaded):
    j, h, b = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
    cols = pl.ds(j * BV, BV)

    def fetch(c, slot):
      fetch_backward((W_g, qg_g, kd_g, Aqk_g, dO_g, sdec_g),
                     tuple(x.at[slot] for x in (W_s, qg_s, kd_s, Aqk_s, dO_s, sdec_s)),
                     b=b, h=h, c=c, cols=cols, C=C, bar=loaded.at[slot])

    for slot in range(stages):
      fetch(N - 1 - slot, slot)
    dS_KV = plgpu.load(dSfin_g.at[b, h, :, cols], layout=plgpu.Layout.WGMMA, optimized=False)

    def step(i, dS_KV):
      c = N - 1 - i
      slot = lax.rem(i, stages)
      rows = pl.ds(c * C, C)
      plgpu.barrier_wait(loaded.at[slot])

      def products(v_acc, s_acc):
        # A_qk^T dO needs no dS: the tensor cores run it while dS goes to shared memory.
        plgpu.wgmma(v_acc, Aqk_s.at[slot].transpose((1, 0)), dO_s.at[slot])
        # Stores go out per chunk as dS, dV': with at most the last dV' store unfinished, the last dS
        # store has read S_s.
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        S_s[...] = dS_KV.astype(bf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(S_s, dSn_g.at[b, h, c, :, cols])
        plgpu.wgmma(v_acc, kd_s.at[slot], S_s)
        plgpu.wgmma(s_acc, qg_s.at[slot].transpose((1, 0)), dO_s.at[slot])
        # Read before the fences below, which order it before the TMA that refills this slot. Scaling
        # dS only after its bf16 copy lets the product take dS's registers.
        dS_dec = scale_rows(dS_KV, load_decay(sdec_s.at[slot]))
        # All but the newest wgmma (qg^T dO) are done, so dV' is whole while qg^T dO still runs. Rows
        # past C are garbage (kd and A_qk were not loaded there); nothing reads or stores them.
        dVp_XV = plgpu.wgmma_accumulator_load(v_acc, wait_n=1)
        Vn_s[...] = (-dVp_XV).astype(bf)
        plgpu.commit_smem()
        plgpu.wgmma(s_acc, W_s.at[slot].transpose((1, 0)), Vn_s.at[pl.ds(0, C)])
        # Likewise the last dV' store, which this chunk's dS store follows, has read Vp_s.
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        Vp_s[...] = dVp_XV.astype(bf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(Vp_s.at[pl.ds(0, C)], dVp_g.at[b, h, rows, cols])
        return dS_dec + s_acc[...]

      dS_KV = pl.run_scoped(products, plgpu.ACC((X, BV), f32), plgpu.ACC((K, BV), f32))
      # Every read of this slot is done: refill it with the chunk `stages` before this one.
      @pl.when(i + stages < N)
      def _():
        fetch(c - stages, slot)

      return dS_KV

    dS_KV = lax.fori_loop(0, N, step, dS_KV)
    dS0_g.at[b, h, :, cols][...] = dS_KV
    plgpu.wait_smem_to_gmem(0)

  scratch = backward_ring(stages, C, K, BV) + [
      plgpu.SMEM((K, BV), bf, transforms=mma(BV)),             # dS, as a B operand and on its way out
      plgpu.SMEM((X, BV), bf, transforms=mma(BV)),             # -dV', as a B operand
      plgpu.SMEM((X, BV), bf, transforms=mma(BV)),             # dV' on its way out
      plgpu.Barrier(num_arrivals=backward_copies(C), num_barriers=stages),  # the copies of one chunk
  ]
  out_type = (jax.ShapeDtypeStruct((B, H, T, V), bf), jax.ShapeDtypeStruct((B, H, N, K, V), bf),
              jax.ShapeDtypeStruct((B, H, K, V), f32))
  run = launch(body, out_type, scratch, grid=(V // BV, H, B), interpret=interpret,
               name="kda_scan_bwd_mosaic")
  return run(dO, Aqk, kd, W, qg, sdec, dSfin)
