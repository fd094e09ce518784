"""KDA's backward state pass on Mosaic GPU with one dependent round trip through the tensor cores per
chunk (the look-ahead form of mosaic_scan_bwd, which makes two: kd dS, then dV', then W^T dV'; see
mosaic_scan_ahead for the forward).

Walking the chunks from the last, with dS_c the cotangent of the state leaving chunk c:
  dV'_c = A_qk,c^T dO_c + kd_c dS_c,   dS_{c-1} = D_c dS_c + qg_c^T dO_c - W_c^T dV'_c,
so chunk c-1's dV' follows from what chunk c already has:
  dV'_{c-1} = A_qk,c-1^T dO_{c-1} + kd_{c-1} (D_c dS_c) + P_c dO_c - Q_c dV'_c,
  P_c = kd_{c-1} qg_c^T,  Q_c = kd_{c-1} W_c^T  [C, C].
Every product of a step reads D_c dS_c or dV'_c, which the step before left in shared memory (with dS_c,
the source of its store), plus the inputs of chunks c and c-1, and one wait covers them all.

- P and Q are made by XLA before the kernel (`ahead_products_backward`), bf16 [B,H,T,C] like A_qk, chunk
  c's rows holding P_c and Q_c (chunk 0's zero). Resets need nothing more, as in the forward: kd's rows
  outside a chunk's last document, W's and qg's outside its first, and sdec where a chunk holds a reset
  are zero.
- Tiles as in mosaic_scan_bwd (its fetch_backward: A_qk transposed from 8-row bands, kd in rows [0, C)
  of a 64-row tile, -dV' as the B operand of the subtracted products, dV' and dS stored from the bf16
  tiles the products read) plus the bf16 D dS tile and a slot of P and Q per chunk, rows [0, C) of
  64-row tiles.
- The ring holds two chunks in use (c and c-1), so it needs two slots and loads ahead with three.

Not used by the op unless Config.mosaic_ahead_bwd is set: it has not been timed on a GPU yet
(benchmarks/kda_backend.py has its rows).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_scan import (
  check_scan,
  launch,
  load_decay,
  scale_rows,
  shape_or_memory,
  smem_buffer,
  smem_transforms,
  tile_rows,
)
from pallas_kernels.kda.mosaic_scan_bwd import (
  backward_copies,
  backward_ring,
  fetch_backward,
  smem_bytes_backward,
)


def ahead_products_backward(kd, qg, W, C: int):
  """(P, Q) [B,H,T,C] bf16: chunk n's rows hold kd_{n-1} qg_n^T and kd_{n-1} W_n^T (chunk 0's zero)."""
  B, H, T, K = kd.shape
  N = T // C
  kd_n, qg_n, W_n = (x.astype(jnp.bfloat16).reshape(B, H, N, C, K) for x in (kd, qg, W))

  def product(x_n):
    out = jnp.einsum("bhnck,bhndk->bhncd", kd_n[:, :, :-1], x_n[:, :, 1:], preferred_element_type=jnp.float32)
    out = jnp.pad(out.astype(jnp.bfloat16), [(0, 0), (0, 0), (1, 0), (0, 0), (0, 0)])
    return out.reshape(B, H, T, C)

  return product(qg_n), product(W_n)


def smem_bytes_backward_ahead(K: int, C: int, block_v: int, stages: int) -> int:
  """Shared memory of one scan_backward_mosaic_ahead program, to the byte as Mosaic GPU counts it:
  mosaic_scan_bwd's buffers plus a slot of P and of Q per chunk and the bf16 D dS tile."""
  X = tile_rows(C)[2]
  bf = jnp.bfloat16
  return (smem_bytes_backward(K, C, block_v, stages) + 2 * smem_buffer(bf, stages, X, C)
          + smem_buffer(bf, K, block_v))


def unsupported_backward_ahead(K: int, C: int, block_v: int, V: int, store_dtype, stages: int) -> str | None:
  """Why scan_backward_mosaic_ahead cannot take these settings in the op; None when it can."""
  if jnp.dtype(store_dtype) != jnp.bfloat16:
    return f"the Mosaic backward scan takes bf16 operands and stores bf16, not {jnp.dtype(store_dtype).name}"
  if stages < 2:
    return f"the look-ahead scan needs at least 2 slots, got {stages}"
  return shape_or_memory(K, C, block_v, V, stages,
                         lambda: smem_bytes_backward_ahead(K, C, block_v, stages))


def scan_backward_mosaic_ahead(dO, Aqk, kd, W, qg, sdec, dSfin, *, store_dtype, block_v: int,
                               stages: int = 3, interpret=False):
  """The same results as mosaic_scan_bwd.scan_backward_mosaic (dV', the dS entering each chunk's update,
  dS0), by the look-ahead form. stages: chunk slots in flight, >= 2 (3 loads one chunk ahead of the two
  in use)."""
  B, H, T, K = W.shape
  V = dO.shape[-1]
  C = Aqk.shape[-1]
  N = T // C
  BV = block_v
  check_scan(K, C, BV, V, T, stages, bf16_stores=(("store_dtype", store_dtype),), min_stages=2)
  stages = min(stages, N)
  X = tile_rows(C)[2]
  bf, f32 = jnp.bfloat16, jnp.float32
  P, Q = ahead_products_backward(kd, qg, W, C)
  dO, Aqk, kd, W, qg = (x.astype(bf) for x in (dO, Aqk, kd, W, qg))
  sdec, dSfin = sdec.astype(f32), dSfin.astype(f32)
  mma = functools.partial(smem_transforms, bf, max_elems=min(BV, C))  # one swizzle, as in mosaic_scan

  def body(dO_g, Aqk_g, kd_g, W_g, qg_g, sdec_g, P_g, Q_g, dSfin_g, dVp_g, dSn_g, dS0_g,
           W_s, qg_s, kd_s, Aqk_s, dO_s, sdec_s, P_s, Q_s, S_s, DS_s, Vn_s, Vp_s, loaded):
    j, h, b = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
    cols = pl.ds(j * BV, BV)
    rows_of = lambda c: pl.ds(c * C, C)

    def fetch(c, slot):
      bar = loaded.at[slot]
      fetch_backward((W_g, qg_g, kd_g, Aqk_g, dO_g, sdec_g),
                     tuple(x.at[slot] for x in (W_s, qg_s, kd_s, Aqk_s, dO_s, sdec_s)),
                     b=b, h=h, c=c, cols=cols, C=C, bar=bar)
      plgpu.copy_gmem_to_smem(P_g.at[b, h, rows_of(c)], P_s.at[slot, pl.ds(0, C)], bar)
      plgpu.copy_gmem_to_smem(Q_g.at[b, h, rows_of(c)], Q_s.at[slot, pl.ds(0, C)], bar)

    decay_of = lambda slot: load_decay(sdec_s.at[slot])

    def put_state(dS_KV, decay_K):
      """The B operands dS and D dS of a chunk whose update dS_KV enters and whose decay is decay_K."""
      S_s[...] = dS_KV.astype(bf)
      DS_s[...] = scale_rows(dS_KV, decay_K).astype(bf)

    def put_values(dVp_XV):
      """-dV' as a B operand (wgmma only adds) and dV' on its way out; rows past C are garbage."""
      Vn_s[...] = (-dVp_XV).astype(bf)
      Vp_s[...] = dVp_XV.astype(bf)

    def store(c):
      plgpu.copy_smem_to_gmem(S_s, dSn_g.at[b, h, c, :, cols])
      plgpu.copy_smem_to_gmem(Vp_s.at[pl.ds(0, C)], dVp_g.at[b, h, rows_of(c), cols])

    for slot in range(stages):  # chunk N-1-s into slot s
      fetch(N - 1 - slot, slot)

    # The last chunk's dV' the two-trip way: A_qk^T dO + kd dS_fin.
    plgpu.barrier_wait(loaded.at[0])
    dS_KV = plgpu.load(dSfin_g.at[b, h, :, cols], layout=plgpu.Layout.WGMMA, optimized=False)
    put_state(dS_KV, decay_of(0))
    plgpu.commit_smem()

    def last_values(v_acc):
      plgpu.wgmma(v_acc, Aqk_s.at[0].transpose((1, 0)), dO_s.at[0])
      plgpu.wgmma(v_acc, kd_s.at[0], S_s)
      return v_acc[...]

    put_values(pl.run_scoped(last_values, plgpu.ACC((X, BV), f32)))
    plgpu.commit_smem()
    store(N - 1)

    def step(i, dS_KV, ahead: bool):
      """Chunk c = N-1-i: dS_{c-1}, and with `ahead` chunk c-1's dV', from S_s, DS_s and Vn_s (chunk c's)."""
      c = N - 1 - i
      slot, pslot = lax.rem(i, stages), lax.rem(i + 1, stages)
      if ahead:
        plgpu.barrier_wait(loaded.at[pslot])

      def products(v_acc, s_acc):
        if ahead:
          # Oldest first: the wait below for dV'_{c-1} leaves this chunk's two products running.
          plgpu.wgmma(v_acc, Aqk_s.at[pslot].transpose((1, 0)), dO_s.at[pslot])
          plgpu.wgmma(v_acc, kd_s.at[pslot], DS_s)
          plgpu.wgmma(v_acc, P_s.at[slot], dO_s.at[slot])
          plgpu.wgmma(v_acc, Q_s.at[slot], Vn_s.at[pl.ds(0, C)])
        plgpu.wgmma(s_acc, qg_s.at[slot].transpose((1, 0)), dO_s.at[slot])
        plgpu.wgmma(s_acc, W_s.at[slot].transpose((1, 0)), Vn_s.at[pl.ds(0, C)])
        # Register work while the tensor cores run: this chunk's decay of dS, the previous one's factors.
        dS_dec = scale_rows(dS_KV, decay_of(slot))
        dVp_prev = prev_decay = None
        if ahead:
          prev_decay = decay_of(pslot)
          dVp_prev = plgpu.wgmma_accumulator_load(v_acc, wait_n=2)
        return dVp_prev, prev_decay, dS_dec + s_acc[...]

      dVp_prev, prev_decay, dS_KV = pl.run_scoped(products, plgpu.ACC((X, BV), f32), plgpu.ACC((K, BV), f32))
      if ahead:
        # The stores of the step before (issued a whole step of work ago) read the tiles rewritten here.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        put_state(dS_KV, prev_decay)
        put_values(dVp_prev)
        plgpu.commit_smem()
      # Every read of chunk c's slot is done, and the fence above orders sdec's before the refill.
      @pl.when(c - stages >= 0)
      def _():
        fetch(c - stages, slot)

      if ahead:
        store(c - 1)
      return dS_KV

    dS_KV = lax.fori_loop(0, N - 1, functools.partial(step, ahead=True), dS_KV)
    dS_KV = step(N - 1, dS_KV, ahead=False)
    dS0_g.at[b, h, :, cols][...] = dS_KV
    plgpu.wait_smem_to_gmem(0)

  scratch = backward_ring(stages, C, K, BV) + [
      plgpu.SMEM((stages, X, C), bf, transforms=mma(C)),       # P, rows [0, C)
      plgpu.SMEM((stages, X, C), bf, transforms=mma(C)),       # Q, rows [0, C)
      plgpu.SMEM((K, BV), bf, transforms=mma(BV)),             # dS, as a B operand and on its way out
      plgpu.SMEM((K, BV), bf, transforms=mma(BV)),             # D dS, as a B operand
      plgpu.SMEM((X, BV), bf, transforms=mma(BV)),             # -dV', as a B operand
      plgpu.SMEM((X, BV), bf, transforms=mma(BV)),             # dV' on its way out
      plgpu.Barrier(num_arrivals=backward_copies(C) + 2, num_barriers=stages),  # the copies, P's and Q's too
  ]
  out_type = (jax.ShapeDtypeStruct((B, H, T, V), bf), jax.ShapeDtypeStruct((B, H, N, K, V), bf),
              jax.ShapeDtypeStruct((B, H, K, V), f32))
  run = launch(body, out_type, scratch, grid=(V // BV, H, B), interpret=interpret,
               name="kda_scan_bwd_mosaic_ahead")
  return run(dO, Aqk, kd, W, qg, sdec, P, Q, dSfin)
