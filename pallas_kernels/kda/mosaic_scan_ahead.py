"""KDA's forward state pass on Mosaic GPU with one dependent round trip through the tensor cores per
chunk (the look-ahead form). mosaic_scan.scan_forward_mosaic makes two: W S, then V' = U - W S, then
A_qk V' and kd^T V'; each waits for the one before, and at B=1 (64 programs for 132 SMs) the pass is
that chain of waits, chunk after chunk (BENCHMARKS.md, "KDA kernel").

The look-ahead form makes chunk c+1's V' from what chunk c already has:
  V'_{c+1} = U_{c+1} - W_{c+1} S_{c+1}
           = U_{c+1} - W_{c+1} (D_c S_c) - M_{c+1} V'_c,   M_{c+1} = W_{c+1} kd_c^T  [C, C],
with D_c = diag(sdec_c). So while chunk c makes its output and the next state,
  O_c = qg_c S_c + A_qk,c V'_c,   S_{c+1} = D_c S_c + kd_c^T V'_c,
the same batch of wgmmas also makes V'_{c+1}: every product of a chunk reads only S_c, D_c S_c and V'_c,
which the chunk before left in shared memory, and one wait covers them all.

- M = W_{c+1} kd_c^T is made by XLA before the kernel (`ahead_products`): one [C, K] x [K, C] product per
  chunk, bf16 operands, float32 accumulation, stored as bf16 [B,H,T,C] like A_qk. Document resets need
  nothing more: W's rows outside the chunk's first document and kd's outside its last are zero, and
  sdec is zero where a chunk holds a reset, so M and D_c S_c carry no state across a reset.
- Rounding differs from the two-trip form: W_{c+1} reads bf16(D_c S_c) and bf16(V'_c) through bf16(M)
  instead of bf16(S_{c+1}). Both are bf16 operands with float32 sums; the tests hold the two forms to
  the same float64 reference.
- The kernel keeps two chunks in use at once (c for O and S, c+1 for W, U, M), so its ring needs two
  slots to run and three to load one chunk ahead (`stages` >= 2; the op passes 3).
- Tiles as in mosaic_scan: [W; qg] stacked, A_qk aligned with qg's rows, garbage rows past C that no
  product reads and no store writes out; S, D S and V' as bf16 B operands; keep mode stores the state
  entering each chunk and V' from those tiles.

Not used by the op unless Config.mosaic_ahead_fwd is set: it has not been timed on a GPU yet
(benchmarks/kda_backend.py has its rows). A review found no hazard; its open speed points: M's XLA pass
(about 0.03-0.05 ms at B=2 T=8192 H=16, to be timed with the kernel) could move into the prep kernel;
the refill and the stores, issued by one thread between a step's last wait and the next step's wgmmas,
could follow the next step's wgmmas with a deeper ring; and ptxas must keep the wgmmas asynchronous
(MOSAIC_GPU_DUMP_PTXAS=1 on the first GPU run: no "wgmma.mma_async instructions are serialized").
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_scan import (
  FORWARD_COPIES,
  check_scan,
  fetch_forward,
  launch,
  load_decay,
  scale_rows,
  shape_or_memory,
  smem_buffer,
  smem_bytes,
  smem_transforms,
  tile_rows,
)


def ahead_products(W, kd, C: int):
  """M [B,H,T,C] bf16: rows of chunk n hold W_n kd_{n-1}^T (chunk 0's are zero)."""
  B, H, T, K = W.shape
  N = T // C
  W_n, kd_n = (x.astype(jnp.bfloat16).reshape(B, H, N, C, K) for x in (W, kd))
  M = jnp.einsum("bhnck,bhndk->bhncd", W_n[:, :, 1:], kd_n[:, :, :-1], preferred_element_type=jnp.float32)
  M = jnp.pad(M.astype(jnp.bfloat16), [(0, 0), (0, 0), (1, 0), (0, 0), (0, 0)])
  return M.reshape(B, H, T, C)


def smem_bytes_ahead(K: int, C: int, block_v: int, stages: int, out_dtype, u_dtype=jnp.bfloat16) -> int:
  """Shared memory of one scan_forward_mosaic_ahead program, to the byte as Mosaic GPU counts it: the
  two-trip form's (mosaic_scan.smem_bytes) plus a slot of M per chunk and the bf16 D S tile."""
  X = tile_rows(C)[2]
  bf = jnp.bfloat16
  return (smem_bytes(K, C, block_v, stages, out_dtype, u_dtype) + smem_buffer(bf, stages, X, C)
          + smem_buffer(bf, K, block_v))


def unsupported_ahead(K: int, C: int, block_v: int, V: int, store_dtype, stages: int) -> str | None:
  """Why scan_forward_mosaic_ahead cannot take these settings in the op (float32 outputs counted, the
  widest it asks for); None when it can."""
  if jnp.dtype(store_dtype) != jnp.bfloat16:
    return f"the Mosaic scan takes bf16 operands and keeps bf16 states, not {jnp.dtype(store_dtype).name}"
  if stages < 2:
    return f"the look-ahead scan needs at least 2 slots, got {stages}"
  return shape_or_memory(K, C, block_v, V, stages,
                         lambda: smem_bytes_ahead(K, C, block_v, stages, jnp.float32))


def scan_forward_mosaic_ahead(W, U, qg, kd, Aqk, sdec, S0, *, out_dtype, block_v: int, stages: int = 3,
                              states_dtype=None, interpret=False):
  """The same results as mosaic_scan.scan_forward_mosaic (o, S_fin, and in keep mode the states entering
  each chunk and V'), by the look-ahead form. stages: chunk slots in flight, >= 2 (3 loads one chunk
  ahead of the two in use)."""
  B, H, T, K = W.shape
  V = U.shape[-1]
  C = Aqk.shape[-1]
  N = T // C
  BV = block_v
  keep = states_dtype is not None
  check_scan(K, C, BV, V, T, stages, bf16_stores=(("states_dtype", states_dtype),) if keep else (),
             min_stages=2)
  stages = min(stages, N)
  R, lo, X = tile_rows(C)
  first = C - lo  # first valid row of the output tile
  bf, f32 = jnp.bfloat16, jnp.float32
  M = ahead_products(W, kd, C)
  W, qg, kd, Aqk = (x.astype(bf) for x in (W, qg, kd, Aqk))
  if U.dtype != f32:
    U = U.astype(bf)
  sdec, S0 = sdec.astype(f32), S0.astype(f32)
  mma = functools.partial(smem_transforms, bf, max_elems=min(BV, C))  # one swizzle, as in mosaic_scan

  def body(W_g, U_g, qg_g, kd_g, Aqk_g, M_g, sdec_g, S0_g, o_g, Sfin_g, *refs):
    states_g, Vp_g = refs[:2] if keep else (None, None)
    Wq_s, kd_s, U_s, Aqk_s, M_s, sdec_s, S_s, DS_s, Vp_s, o_s, loaded = refs[2 * keep:]
    j, h, b = lax.axis_index("v"), lax.axis_index("h"), lax.axis_index("b")
    cols = pl.ds(j * BV, BV)
    rows_of = lambda c: pl.ds(c * C, C)

    def fetch(c, slot):
      bar = loaded.at[slot]
      fetch_forward((W_g, U_g, qg_g, kd_g, Aqk_g, sdec_g),
                    tuple(x.at[slot] for x in (Wq_s, kd_s, U_s, Aqk_s, sdec_s)),
                    b=b, h=h, c=c, cols=cols, C=C, first=first, bar=bar)
      plgpu.copy_gmem_to_smem(M_g.at[b, h, rows_of(c)], M_s.at[slot, pl.ds(0, C)], bar)

    decay_of = lambda slot: load_decay(sdec_s.at[slot])

    def put_state(S_KV, decay_K):
      """The B operands S and D S of a chunk entered with state S_KV, whose decay factors are decay_K."""
      S_s[...] = S_KV.astype(bf)
      DS_s[...] = scale_rows(S_KV, decay_K).astype(bf)

    for slot in range(stages):
      fetch(slot, slot)

    # Chunk 0's V' the two-trip way: U_0 - W_0 S_0.
    plgpu.barrier_wait(loaded.at[0])
    S_KV = plgpu.load(S0_g.at[b, h, :, cols], layout=plgpu.Layout.WGMMA, optimized=False)
    put_state(S_KV, decay_of(0))
    plgpu.commit_smem()

    def first_values(y_acc):
      plgpu.wgmma(y_acc, Wq_s.at[0, pl.ds(0, X)], S_s)
      return U_s.at[0][...].astype(f32) - y_acc[...]

    Vp_s[...] = pl.run_scoped(first_values, plgpu.ACC((X, BV), f32)).astype(bf)
    plgpu.commit_smem()
    if keep:
      plgpu.copy_smem_to_gmem(S_s, states_g.at[b, h, 0, :, cols])
      plgpu.copy_smem_to_gmem(Vp_s.at[pl.ds(0, C)], Vp_g.at[b, h, rows_of(0), cols])
      # The steps' epilogues leave one store (an O) in flight when they overwrite S_s and Vp_s; here
      # the last store is V'_0's, so wait for both once.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def step(c, S_KV, ahead: bool):
      """Chunk c's O and S_{c+1}, and with `ahead` chunk c+1's V', from S_s, DS_s and Vp_s (chunk c's)."""
      slot, nslot = lax.rem(c, stages), lax.rem(c + 1, stages)
      if ahead:
        plgpu.barrier_wait(loaded.at[nslot])

      def products(y_acc, s_acc, o_acc):
        # Oldest first, as they are waited for: V'_{c+1} (the chain), then the state, then O.
        if ahead:
          plgpu.wgmma(y_acc, Wq_s.at[nslot, pl.ds(0, X)], DS_s)
          plgpu.wgmma(y_acc, M_s.at[nslot], Vp_s.at[pl.ds(0, C)])
        plgpu.wgmma(s_acc, kd_s.at[slot].transpose((1, 0)), Vp_s.at[pl.ds(0, C)])
        # qg S on rows [C, 2C) of the stacked tile, which the output tile's rows line up with; A_qk sits
        # in the same rows of its own tile.
        plgpu.wgmma(o_acc, Wq_s.at[slot, pl.ds(lo, R - lo)], S_s)
        plgpu.wgmma(o_acc, Aqk_s.at[slot], Vp_s.at[pl.ds(0, C)])
        # Register work while the tensor cores run: this chunk's decay of S, and the next one's decay
        # factors for D S.
        S_dec = scale_rows(S_KV, decay_of(slot))
        Vp_next = next_decay = None
        if ahead:
          next_decay = decay_of(nslot)
          # Rows past C are garbage (U and M were not loaded there) and are never read back.
          Vp_next = U_s.at[nslot][...].astype(f32) - plgpu.wgmma_accumulator_load(y_acc, wait_n=3)
        S_next = S_dec + plgpu.wgmma_accumulator_load(s_acc, wait_n=2)  # while O's products run
        return Vp_next, S_next, next_decay, o_acc[...]

      Vp_next, S_KV, next_decay, o_OV = pl.run_scoped(
          products, plgpu.ACC((X, BV), f32), plgpu.ACC((K, BV), f32), plgpu.ACC((R - lo, BV), f32))
      # Stores go out per step as state, V' (keep mode) and O. With at most the last O store unfinished,
      # the state and V' tiles have been read, and so has the output tile of two steps ago.
      plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      out = o_s.at[lax.rem(c, 2)]
      out[...] = o_OV.astype(out_dtype)
      if ahead:
        put_state(S_KV, next_decay)
        Vp_s[...] = Vp_next.astype(bf)
      plgpu.commit_smem()
      # Every read of chunk c's slot is done (its W, U and M went into the step before), and the fence
      # above orders the last, sdec's into registers, before the copies that refill it.
      @pl.when(c + stages < N)
      def _():
        fetch(c + stages, slot)

      if keep and ahead:
        plgpu.copy_smem_to_gmem(S_s, states_g.at[b, h, c + 1, :, cols])
        plgpu.copy_smem_to_gmem(Vp_s.at[pl.ds(0, C)], Vp_g.at[b, h, rows_of(c + 1), cols])
      plgpu.copy_smem_to_gmem(out.at[pl.ds(first, C)], o_g.at[b, rows_of(c), h, cols])
      return S_KV

    S_KV = lax.fori_loop(0, N - 1, functools.partial(step, ahead=True), S_KV)
    S_KV = step(N - 1, S_KV, ahead=False)
    Sfin_g.at[b, h, :, cols][...] = S_KV
    plgpu.wait_smem_to_gmem(0)

  scratch = [
      plgpu.SMEM((stages, R, K), bf, transforms=mma(K)),      # [W; qg]
      plgpu.SMEM((stages, C, K), bf, transforms=mma(K)),      # kd
      plgpu.SMEM((stages, X, BV), U.dtype, transforms=smem_transforms(U.dtype, BV)),  # U
      plgpu.SMEM((stages, R - lo, C), bf, transforms=mma(C)),  # A_qk
      plgpu.SMEM((stages, X, C), bf, transforms=mma(C)),      # M, rows [0, C)
      plgpu.SMEM((stages, K), f32),                           # sdec
      plgpu.SMEM((K, BV), bf, transforms=mma(BV)),            # S, as a B operand and on its way out
      plgpu.SMEM((K, BV), bf, transforms=mma(BV)),            # D S, as a B operand
      plgpu.SMEM((X, BV), bf, transforms=mma(BV)),            # V', as a B operand and on its way out
      plgpu.SMEM((2, R - lo, BV), out_dtype, transforms=smem_transforms(out_dtype, BV)),  # O on its way out
      plgpu.Barrier(num_arrivals=FORWARD_COPIES + 1, num_barriers=stages),  # the copies of one chunk, M's too
  ]
  out_type = [jax.ShapeDtypeStruct((B, T, H, V), out_dtype), jax.ShapeDtypeStruct((B, H, K, V), f32)]
  if keep:
    out_type += [jax.ShapeDtypeStruct((B, H, N, K, V), bf), jax.ShapeDtypeStruct((B, H, T, V), bf)]
  run = launch(body, tuple(out_type), scratch, grid=(V // BV, H, B), interpret=interpret,
               name="kda_scan_fwd_mosaic_ahead")
  out = run(W, U, qg, kd, Aqk, M, sdec, S0)
  return tuple(out) if keep else (*out, None, None)
