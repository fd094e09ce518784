"""The forward inter-chunk state pass of KDA (scan.scan_forward) on the Mosaic GPU lowering; the
backward is in scan_backward.py, the helpers both share and the limits in common.py, the walk in
segments in scan_segmented.py. The two Pallas lowerings can be measured side by side
(benchmarks/kda_backend.py); the op runs both ports where they apply (config.Config.scan_lowering), where
they measured faster than the Triton passes (BENCHMARKS.md, "Pallas backend: Triton vs Mosaic GPU").

Forward (scan_forward_mosaic). Same recurrence and grid as the Triton version: one program (one
warpgroup, one CUDA block) per (V block, head, batch row) walks the N = T/C chunks in order with a [K, BV]
float32 state S:
  V' = U - W S,  O = qg S + A_qk V',  S <- sdec * S + kd^T V'.

How it maps onto Hopper:
- Every product is a wgmma (plgpu.wgmma) with bf16 operands in shared memory and float32 accumulation,
  the Triton version's "bf16" precision; float32 product operands are rounded to bf16 on entry (no TF32
  path: wgmma cannot transpose 32-bit operands, and kd^T V' needs exactly that). U, which enters no
  product, keeps its dtype.
- S stays in registers as a wgmma accumulator [K, BV]; each chunk writes its bf16 copy to shared memory
  because wgmma reads B operands only from there. V' takes the same trip before A_qk V' and kd^T V'.
- wgmma tiles have 64 rows per warpgroup, which a chunk of 32 fills only half. So W and qg share one
  tile, W in rows [0, C) and qg in [C, 2C) (rounded up to whole 64-row tiles): one wgmma gives W S and
  qg S, at C = 32 as a single full tile. A_qk is loaded into the rows of its tile that line up with qg S,
  so A_qk V' lands on the rows that already hold qg S and O is one add. U - W S is formed on whole tiles:
  its rows past C are garbage (never loaded), which no product reads (the products that contract over
  the chunk read V' rows [0, C) only) and no store writes out. C = 32 and 64 waste no tensor-core rows;
  C = 16 wastes half of the shared tile.
- The chunk's six operands (W, qg, kd, U, A_qk, sdec) arrive by TMA into a ring of `stages` shared-memory
  slots, all counted on one barrier per slot, so chunks c+1.. load while chunk c computes (the Triton
  version gets the same from num_stages). O leaves through a double-buffered shared tile and a TMA store
  that overlaps the next chunk. S0 and the final state go straight between registers and global memory.
- Keep mode (states_dtype, for the backward pass) stores the state entering each chunk and V' by TMA from
  the bf16 shared tiles of S and V' that the products read anyway: no extra shared memory or conversion,
  hence states_dtype must be bf16. Those tiles stay single-buffered: the next chunk, before overwriting
  one, waits until its store (issued a whole chunk of work earlier) has read it, which should never
  stall, where double buffers would cost 2 (K + X) BV more bytes (smem_bytes' slack for slots and for a
  second program per SM).
- A wgmma's two shared-memory operands must share one swizzle in this Mosaic GPU version, so every bf16
  tile uses 2 * min(BV, C, 64) bytes: BV = 16 forces the narrowest, 32 bytes; BV = 64 with C = 64 gets
  the full 128 bytes.

Look-ahead forms of both passes (the next chunk's V' or dV' made in this chunk's round of wgmmas, one
round trip through the tensor cores per chunk instead of two) measured slower on the H200 and were
removed (BENCHMARKS.md, "Pallas backend: Triton vs Mosaic GPU").

Limits and interpret mode: common.py.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic import scan_segmented
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

FORWARD_COPIES = 6  # the TMA copies of one chunk in fetch_forward


def fetch_forward(src, dst, *, b, h, c, cols, C: int, first: int, bar):
  """Copies chunk c's forward operands src = (W, U, qg, kd, A_qk, sdec) in global memory into one slot's
  tiles dst = ([W; qg], kd, U, A_qk, sdec): W and qg stacked, U in rows [0, C), A_qk in rows
  [first, first + C) to line up with qg S. FORWARD_COPIES copies, all counted on `bar`."""
  W_g, U_g, qg_g, kd_g, Aqk_g, sdec_g = src
  Wq_s, kd_s, U_s, Aqk_s, sdec_s = dst
  rows = pl.ds(c * C, C)
  plgpu.copy_gmem_to_smem(W_g.at[b, h, rows], Wq_s.at[pl.ds(0, C)], bar)
  plgpu.copy_gmem_to_smem(qg_g.at[b, h, rows], Wq_s.at[pl.ds(C, C)], bar)
  plgpu.copy_gmem_to_smem(kd_g.at[b, h, rows], kd_s, bar)
  plgpu.copy_gmem_to_smem(U_g.at[b, h, rows, cols], U_s.at[pl.ds(0, C)], bar)
  plgpu.copy_gmem_to_smem(Aqk_g.at[b, h, rows], Aqk_s.at[pl.ds(first, C)], bar)
  plgpu.copy_gmem_to_smem(sdec_g.at[b, h, c], sdec_s, bar)


def smem_bytes(K: int, C: int, block_v: int, stages: int, out_dtype, u_dtype=jnp.bfloat16) -> int:
  """Shared memory of one program, to the byte as Mosaic GPU counts it against the limit: `stages` chunk
  slots, the bf16 state and V', two output tiles (each buffer rounded up to the 1 KiB Mosaic aligns
  scratch to) and one 8-byte barrier per slot. Keep mode stores from the state and V' tiles and needs
  nothing more."""
  R, lo, X = tile_rows(C)
  size, bf = smem_buffer, jnp.bfloat16
  buffers = (size(bf, stages, R, K), size(bf, stages, C, K), size(u_dtype, stages, X, block_v),
             size(bf, stages, R - lo, C), size(jnp.float32, stages, K), size(bf, K, block_v),
             size(bf, X, block_v), size(out_dtype, 2, R - lo, block_v))
  return sum(buffers) + 8 * stages


def unsupported(K: int, C: int, block_v: int, V: int, store_dtype, stages: int) -> str | None:
  """Why scan_forward_mosaic cannot take these settings where the op stores its intermediates (and keeps
  states and V') in store_dtype; None when it can. Shared memory is counted with float32 outputs, the
  widest the op asks for."""
  if jnp.dtype(store_dtype) != jnp.bfloat16:
    return f"the Mosaic scan takes bf16 operands and keeps bf16 states, not {jnp.dtype(store_dtype).name}"
  return shape_or_memory(K, C, block_v, V, stages, lambda: smem_bytes(K, C, block_v, stages, jnp.float32))


def scan_forward_mosaic(W, U, qg, kd, Aqk, sdec, S0, *, out_dtype, block_v: int, stages: int = 2,
                        states_dtype=None, segments: int = 1, interpret=False):
  """Returns (o, S_fin, states, V') like scan.scan_forward: o [B,T,H,V] in out_dtype, the final
  state [B,H,K,V] float32, and, when states_dtype is given, the state entering each chunk [B,H,N,K,V] and
  V' = U - W S [B,H,T,V] in that dtype (else None, None). states_dtype must be bf16 (ValueError
  otherwise): the stores reuse the bf16 tiles the products read. stages: chunk slots in flight (2:
  double-buffered). segments > 1 (not with states_dtype): the chunks are walked in that many segments at
  once (module docstring of scan_segmented). interpret: True (or plgpu.InterpretGPUParams) runs the
  kernel in Mosaic GPU interpret mode on the CPU."""
  if segments != 1:
    if states_dtype is not None:
      raise ValueError("a segmented scan keeps no states: its later segments' are off by their entering "
                       "state's part")
    B, H, _, K = W.shape
    S0_ext = scan_segmented.initial_states(S0, segments, B=B, H=H, K=K, V=U.shape[-1])
    o, o_hom, S_ext = scan_kernel(W, U, qg, kd, Aqk, sdec, S0_ext, out_dtype=out_dtype, block_v=block_v,
                                  stages=stages, segments=segments, interpret=interpret)
    return (*scan_segmented.join(o, o_hom, S_ext, segments, interpret=bool(interpret)), None, None)
  o, S_fin, *kept = scan_kernel(W, U, qg, kd, Aqk, sdec, S0, out_dtype=out_dtype, block_v=block_v,
                                stages=stages, states_dtype=states_dtype, interpret=interpret)
  return (o, S_fin, *kept) if kept else (o, S_fin, None, None)


def scan_kernel(W, U, qg, kd, Aqk, sdec, S0, *, out_dtype, block_v: int, stages: int, states_dtype=None,
                segments: int = 1, interpret=False):
  """The forward pass's kernel. With segments = 1: (o, S_fin) or (o, S_fin, states, V') as
  scan_forward_mosaic returns them. With P = segments > 1 the N chunks split into P segments (Ns =
  scan_segmented.segment_length chunks each, the last the rest), all walked at once, each from its own
  state S0 [B*P,H,K,V+K] (row b*P + p: segment p of batch row b), and K more column blocks per segment
  walk the homogeneous pass: U read as zero, from S0's last K columns (the identity, where the caller
  wants the segment's transition). Returns (o [B,T,H,V] of the local passes, the homogeneous passes' outputs
  [B,T-Ns*C,H,K] of segments 1..P-1, the final states [B*P,H,K,V+K]); segment 0's homogeneous programs
  do not run, their final state columns are left unwritten."""
  B, H, T, K = W.shape
  V = U.shape[-1]
  C = Aqk.shape[-1]
  N = T // C
  BV = block_v
  P = segments
  keep = states_dtype is not None
  check_scan(K, C, BV, V, T, stages, bf16_stores=(("states_dtype", states_dtype),) if keep else ())
  Ns = scan_segmented.segment_length(N, P, C) if P > 1 else N
  if P > 1 and (keep or Ns is None or K % BV):
    raise ValueError(f"a scan in {P} segments needs no kept states, a chunk in every segment ({N} chunks) "
                     f"and V blocks ({BV}) that divide K ({K})")
  last = N - (P - 1) * Ns  # chunks of the last segment
  nV = V // BV
  stages = min(stages, Ns)
  R, lo, X = tile_rows(C)
  first = C - lo  # first valid row of the output tile
  bf, f32 = jnp.bfloat16, jnp.float32
  W, qg, kd, Aqk = (x.astype(bf) for x in (W, qg, kd, Aqk))
  if U.dtype != f32:
    U = U.astype(bf)
  sdec, S0 = sdec.astype(f32), S0.astype(f32)
  # One swizzle for every bf16 operand (see the docstring): B tiles are BV wide and the chunk-contracting
  # products step through C in swizzle-wide groups.
  mma = functools.partial(smem_transforms, bf, max_elems=min(BV, C))

  def body(W_g, U_g, qg_g, kd_g, Aqk_g, sdec_g, S0_g, o_g, *refs):
    ohom_g, refs = (refs[0], refs[1:]) if P > 1 else (None, refs)
    Sfin_g, refs = refs[0], refs[1:]
    states_g, Vp_g = refs[:2] if keep else (None, None)
    Wq_s, kd_s, U_s, Aqk_s, sdec_s, S_s, Vp_s, o_s, loaded = refs[2 * keep:]
    j, h, bp = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
    b, p = (lax.div(bp, P), lax.rem(bp, P)) if P > 1 else (bp, 0)
    cols = pl.ds(j * BV, BV)
    # A homogeneous block (j >= nV) reads any U block and zeroes it.
    u_cols = pl.ds(jnp.minimum(j, nV - 1) * BV, BV) if P > 1 else cols
    start = p * Ns  # the segment's first chunk
    # Its chunks: a traced count only where the last segment is shorter.
    n = Ns if last == Ns else jnp.where(p == P - 1, last, Ns)

    def walk():
      def fetch(c, slot):
        fetch_forward((W_g, U_g, qg_g, kd_g, Aqk_g, sdec_g),
                      tuple(x.at[slot] for x in (Wq_s, kd_s, U_s, Aqk_s, sdec_s)),
                      b=b, h=h, c=start + c, cols=u_cols, C=C, first=first, bar=loaded.at[slot])

      for slot in range(stages):
        if slot < last:
          fetch(slot, slot)
        else:
          pl.when(slot < n)(functools.partial(fetch, slot, slot))
      S_KV = plgpu.load(S0_g.at[bp, h, :, cols], layout=plgpu.Layout.WGMMA, optimized=False)

      def step(c, S_KV):
        slot = lax.rem(c, stages)
        plgpu.barrier_wait(loaded.at[slot])
        rows = pl.ds((start + c) * C, C)
        if keep:
          # Stores go out per chunk as state, V', O; leaving only the last two (V', O) unfinished makes
          # sure the last state store has read S_s.
          plgpu.wait_smem_to_gmem(2, wait_read_only=True)
        S_s[...] = S_KV.astype(bf)
        plgpu.commit_smem()  # the bf16 state must be visible to the tensor cores (and to TMA)
        if keep:
          plgpu.copy_smem_to_gmem(S_s, states_g.at[b, h, c, :, cols])

        def products(y_acc, o_acc, s_acc):
          # [W; qg] S in one wgmma: rows [0, C) are W S, rows [C, 2C) qg S.
          plgpu.wgmma(y_acc, Wq_s.at[slot], S_s)
          U_XV = U_s.at[slot][...].astype(f32)
          if P > 1:
            U_XV = U_XV * (j < nV).astype(f32)
          decay_K = load_decay(sdec_s.at[slot])
          Y_RV = y_acc[...]
          if keep:
            # Likewise for the last V' store, which the last O store and this chunk's state store follow.
            plgpu.wait_smem_to_gmem(2, wait_read_only=True)
          # Rows past C of V' are garbage (U was not loaded there) and are never read back.
          Vp_s[...] = (U_XV - Y_RV[:X]).astype(bf)
          plgpu.commit_smem()
          if keep:
            plgpu.copy_smem_to_gmem(Vp_s.at[pl.ds(0, C)], Vp_g.at[b, h, rows, cols])
          # A_qk sits in the rows of its tile that line up with qg S in Y_RV[lo:].
          plgpu.wgmma(o_acc, Aqk_s.at[slot], Vp_s.at[pl.ds(0, C)])
          plgpu.wgmma(s_acc, kd_s.at[slot].transpose((1, 0)), Vp_s.at[pl.ds(0, C)])
          S_dec = scale_rows(S_KV, decay_K)  # overlaps the two wgmmas
          return Y_RV[lo:] + o_acc[...], S_dec + s_acc[...]

        o_OV, S_KV = pl.run_scoped(products, plgpu.ACC((R, BV), f32), plgpu.ACC((R - lo, BV), f32),
                                   plgpu.ACC((K, BV), f32))
        # Every read of this slot is done: refill it with the chunk `stages` ahead.
        @pl.when(c + stages < n)
        def _():
          fetch(c + stages, slot)

        # The O store issued two chunks ago used this output tile; the previous one may still be in flight
        # (in keep mode, so may this chunk's state and V' stores issued after it).
        out = o_s.at[lax.rem(c, 2)]
        plgpu.wait_smem_to_gmem(1 + 2 * keep, wait_read_only=True)
        out[...] = o_OV.astype(out_dtype)
        plgpu.commit_smem()
        if P == 1:
          plgpu.copy_smem_to_gmem(out.at[pl.ds(first, C)], o_g.at[b, rows, h, cols])
        else:
          @pl.when(j < nV)
          def _():
            plgpu.copy_smem_to_gmem(out.at[pl.ds(first, C)], o_g.at[b, rows, h, cols])

          @pl.when(j >= nV)
          def _():
            plgpu.copy_smem_to_gmem(out.at[pl.ds(first, C)],
                                    ohom_g.at[b, pl.ds((start - Ns + c) * C, C), h, pl.ds((j - nV) * BV, BV)])
        return S_KV

      S_KV = lax.fori_loop(0, n, step, S_KV)
      Sfin_g.at[bp, h, :, cols][...] = S_KV
      plgpu.wait_smem_to_gmem(0)

    if P == 1:
      walk()
    else:
      # Segment 0 walks no homogeneous pass: its programs for those blocks have nothing to do.
      pl.when(jnp.logical_or(j < nV, p > 0))(walk)

  scratch = [
      plgpu.SMEM((stages, R, K), bf, transforms=mma(K)),      # [W; qg]
      plgpu.SMEM((stages, C, K), bf, transforms=mma(K)),      # kd
      plgpu.SMEM((stages, X, BV), U.dtype, transforms=smem_transforms(U.dtype, BV)),  # U
      plgpu.SMEM((stages, R - lo, C), bf, transforms=mma(C)),  # A_qk
      plgpu.SMEM((stages, K), f32),                           # sdec
      plgpu.SMEM((K, BV), bf, transforms=mma(BV)),            # the state, as a B operand
      plgpu.SMEM((X, BV), bf, transforms=mma(BV)),            # V', as a B operand
      plgpu.SMEM((2, R - lo, BV), out_dtype, transforms=smem_transforms(out_dtype, BV)),  # O on its way out
      plgpu.Barrier(num_arrivals=FORWARD_COPIES, num_barriers=stages),  # the copies of one chunk
  ]
  out_type = [jax.ShapeDtypeStruct((B, T, H, V), out_dtype)]
  if P > 1:
    out_type += [jax.ShapeDtypeStruct((B, T - Ns * C, H, K), out_dtype),
                 jax.ShapeDtypeStruct((B * P, H, K, V + K), f32)]
  else:
    out_type += [jax.ShapeDtypeStruct((B, H, K, V), f32)]
  if keep:
    out_type += [jax.ShapeDtypeStruct((B, H, N, K, V), bf), jax.ShapeDtypeStruct((B, H, T, V), bf)]
  blocks = nV + (K // BV if P > 1 else 0)
  run = launch(body, tuple(out_type), scratch, grid=(blocks, H, B * P), interpret=interpret,
               name="kda_scan_fwd_mosaic" if P == 1 else "kda_scan_fwd_mosaic_split")
  return tuple(run(W, U, qg, kd, Aqk, sdec, S0))
