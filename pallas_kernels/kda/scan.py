"""The sequential inter-chunk state pass of KDA, forward and backward, on the Triton lowering (its Mosaic
GPU ports are in mosaic/).

The V columns of the state evolve independently, so each program owns one (V block, head, batch row)
and walks the chunks in order (forward) or in reverse (backward). Small V blocks put more programs in
flight, which is what a scan over few, long sequences needs to fill the GPU.

Forward, per chunk with incoming state S [K,BV]:
  V' = U - W S,  O = qg S + A_qk V',  S <- sdec * S + kd^T V'.
Backward, per chunk from the last, with dS the cotangent of the outgoing state:
  dV' = A_qk^T dO + kd dS,  dS <- sdec * dS + qg^T dO - W^T dV'.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.lowering import Tuning, dot, dot_tn, launch


def _check_block(V, block_v):
  if V % block_v:
    raise ValueError(f"V block {block_v} must divide the (padded) value width {V}")


def scan_forward(W, U, qg, kd, Aqk, sdec, S0, *, out_dtype, block_v: int, big: str, states_dtype=None,
                 interpret: bool, tuning: Tuning):
  """Returns o [B,T,H,V] in out_dtype, the final state [B,H,K,V] float32, and, when states_dtype is
  given, the state entering each chunk [B,H,N,K,V] and V' [B,H,T,V] in that dtype (else None, None)."""
  B, H, T, K = W.shape
  V = U.shape[-1]
  C = Aqk.shape[-1]
  N = T // C
  _check_block(V, block_v)
  keep = states_dtype is not None

  def kernel(W_ref, U_ref, qg_ref, kd_ref, Aqk_ref, sdec_ref, S0_ref, o_ref, Sfin_ref, *kept):
    j, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)

    def step(c, S_KV):
      rows = pl.ds(c * C, C)
      Vp_CV = U_ref[b, h, rows, cols].astype(jnp.float32) - dot(W_ref[b, h, rows, :], S_KV, big)
      if keep:
        states_ref, Vp_ref = kept
        states_ref[b, h, c, :, cols] = S_KV.astype(states_ref.dtype)
        Vp_ref[b, h, rows, cols] = Vp_CV.astype(Vp_ref.dtype)
      o_CV = dot(qg_ref[b, h, rows, :], S_KV, big) + dot(Aqk_ref[b, h, rows, :], Vp_CV, big)
      o_ref[b, rows, h, cols] = o_CV.astype(o_ref.dtype)
      return sdec_ref[b, h, c, :][:, None] * S_KV + dot_tn(kd_ref[b, h, rows, :], Vp_CV, big)

    S_KV = jax.lax.fori_loop(0, N, step, S0_ref[b, h, :, cols].astype(jnp.float32))
    Sfin_ref[b, h, :, cols] = S_KV

  out_shape = [jax.ShapeDtypeStruct((B, T, H, V), out_dtype), jax.ShapeDtypeStruct((B, H, K, V), jnp.float32)]
  if keep:
    out_shape += [jax.ShapeDtypeStruct((B, H, N, K, V), states_dtype),
                  jax.ShapeDtypeStruct((B, H, T, V), states_dtype)]
  out = launch(kernel, grid=(V // block_v, H, B), out_shape=tuple(out_shape), interpret=interpret,
               tuning=tuning, name="kda_scan_fwd")(W, U, qg, kd, Aqk, sdec, S0)
  return (out[0], out[1]) + (tuple(out[2:]) if keep else (None, None))


def scan_backward(dO, Aqk, kd, W, qg, sdec, dSfin, *, store_dtype, block_v: int, big: str, interpret: bool,
                  tuning: Tuning):
  """Returns dV' [B,H,T,V] and the cotangent of the state leaving each chunk [B,H,N,K,V], both in
  store_dtype, and the cotangent of the initial state [B,H,K,V] float32."""
  B, H, T, K = W.shape
  V = dO.shape[-1]
  C = Aqk.shape[-1]
  N = T // C
  _check_block(V, block_v)

  def kernel(dO_ref, Aqk_ref, kd_ref, W_ref, qg_ref, sdec_ref, dSfin_ref, dVp_ref, dSn_ref, dS0_ref):
    j, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)

    def step(i, dS_KV):
      c = N - 1 - i
      rows = pl.ds(c * C, C)
      dSn_ref[b, h, c, :, cols] = dS_KV.astype(dSn_ref.dtype)
      dO_CV = dO_ref[b, rows, h, cols]
      dVp_CV = dot_tn(Aqk_ref[b, h, rows, :], dO_CV, big) + dot(kd_ref[b, h, rows, :], dS_KV, big)
      dVp_ref[b, h, rows, cols] = dVp_CV.astype(dVp_ref.dtype)
      return (sdec_ref[b, h, c, :][:, None] * dS_KV + dot_tn(qg_ref[b, h, rows, :], dO_CV, big)
              - dot_tn(W_ref[b, h, rows, :], dVp_CV, big))

    dS_KV = jax.lax.fori_loop(0, N, step, dSfin_ref[b, h, :, cols].astype(jnp.float32))
    dS0_ref[b, h, :, cols] = dS_KV

  out_shape = (jax.ShapeDtypeStruct((B, H, T, V), store_dtype),
               jax.ShapeDtypeStruct((B, H, N, K, V), store_dtype),
               jax.ShapeDtypeStruct((B, H, K, V), jnp.float32))
  return launch(kernel, grid=(V // block_v, H, B), out_shape=out_shape, interpret=interpret, tuning=tuning,
                name="kda_scan_bwd")(dO, Aqk, kd, W, qg, sdec, dSfin)
