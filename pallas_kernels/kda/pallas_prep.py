"""The chunk-parallel KDA kernels: one program per (chunk, head, batch row).

prep_forward:  inputs -> W, U, qg, kd, A_qk, sdec for the state pass (pallas_tiles.prep).
state_grads:   states, their cotangents, dO, dV', V' -> dW, dqg, dkd, dA_qk, dsdec (pallas_tiles.state_grads).
prep_backward: those cotangents -> dq, dk, dv, dg, dbeta (pallas_tiles.prep_vjp).

Layouts: q, k, g [B,T,H,K], v [B,T,H,V], beta [B,T,H], doc [B,T] as the caller gives them (T padded to
a whole number of chunks); per-chunk results [B,H,T,*] so the sequential pass reads contiguous tiles;
sdec [B,H,N,K]; states [B,H,N,K,V]. Kernels read and write 16-row tiles in column blocks of `block`.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import pallas_tiles as tiles
from pallas_kernels.kda.pallas_backend import Tuning, launch

TILE = tiles.TILE


def _rows(c, C, p):
  return pl.ds(c * C + p * TILE, TILE)


class _Chunk:
  """Tile views and sinks of one program's chunk c, head h, batch row b."""

  def __init__(self, C, block):
    self.c, self.h, self.b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    self.C, self.P, self.block = C, C // TILE, block

  def cols(self, i):
    return pl.ds(i * self.block, self.block)

  def btx(self, ref):
    """Tiles of a [B,T,H,X] ref."""
    return tiles.Tiles(self.P, ref.shape[-1] // self.block,
                       lambda p, i: ref[self.b, _rows(self.c, self.C, p), self.h, self.cols(i)])

  def bhtx(self, ref):
    """Tiles of a [B,H,T,X] ref."""
    return tiles.Tiles(self.P, ref.shape[-1] // self.block,
                       lambda p, i: ref[self.b, self.h, _rows(self.c, self.C, p), self.cols(i)])

  def put_btx(self, ref):
    def put(p, i, x):
      ref[self.b, _rows(self.c, self.C, p), self.h, self.cols(i)] = x.astype(ref.dtype)
    return put

  def put_bhtx(self, ref):
    def put(p, i, x):
      ref[self.b, self.h, _rows(self.c, self.C, p), self.cols(i)] = x.astype(ref.dtype)
    return put

  def put_blocks(self, ref):
    """Sink of 16x16 blocks (p, r) of a [B,H,T,C] ref."""
    def put(p, r, x):
      ref[self.b, self.h, _rows(self.c, self.C, p), pl.ds(r * TILE, TILE)] = x.astype(ref.dtype)
    return put

  def put_per_chunk(self, ref):
    """Sink of [BK] blocks of a [B,H,N,K] ref."""
    def put(i, x):
      ref[self.b, self.h, self.c, self.cols(i)] = x.astype(ref.dtype)
    return put

  def inputs(self, q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref):
    rows = lambda ref: tiles.Rows(lambda p: ref[self.b, _rows(self.c, self.C, p), self.h])
    return (self.btx(q_ref), self.btx(k_ref), self.btx(v_ref), self.btx(g_ref), rows(beta_ref),
            tiles.Rows(lambda p: doc_ref[self.b, _rows(self.c, self.C, p)]))


def prep_forward(q, k, v, g, beta, doc, *, chunk: int, block: int, scale: float, prec: tiles.Precision,
                 store_dtype, interpret: bool, tuning: Tuning):
  """Returns W, U, qg, kd, Aqk, sdec: [B,H,T,K|V|K|K|C] in store_dtype and [B,H,N,K] float32."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  C, N = chunk, T // chunk

  def kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, W_ref, U_ref, qg_ref, kd_ref, Aqk_ref,
             sdec_ref):
    ch = _Chunk(C, block)
    put = tiles.Prep(W=ch.put_bhtx(W_ref), U=ch.put_bhtx(U_ref), qg=ch.put_bhtx(qg_ref),
                     kd=ch.put_bhtx(kd_ref), Aqk=ch.put_blocks(Aqk_ref), sdec=ch.put_per_chunk(sdec_ref))
    tiles.prep(*ch.inputs(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref), scale, prec, put)

  sd = lambda *shape: jax.ShapeDtypeStruct(shape, store_dtype)
  out_shape = (sd(B, H, T, K), sd(B, H, T, V), sd(B, H, T, K), sd(B, H, T, K), sd(B, H, T, C),
               jax.ShapeDtypeStruct((B, H, N, K), jnp.float32))
  return launch(kernel, grid=(N, H, B), out_shape=out_shape, interpret=interpret, tuning=tuning,
                name="kda_prep_fwd")(q, k, v, g, beta, doc)


def state_grads(states, dS_next, dO, dVp, Vp, *, block: int, prec: tiles.Precision, store_dtype,
                interpret: bool, tuning: Tuning):
  """Returns dW, dqg, dkd [B,H,T,K] and dAqk [B,H,T,C] in store_dtype, dsdec [B,H,N,K] float32.

  states, dS_next [B,H,N,K,V]: the state entering each chunk and the cotangent of the one leaving it;
  dO [B,T,H,V]; dVp, Vp [B,H,T,V].
  """
  B, H, N, K, V = states.shape
  T = dVp.shape[2]
  C = T // N

  def kernel(S_ref, dSn_ref, dO_ref, dVp_ref, Vp_ref, dW_ref, dqg_ref, dkd_ref, dAqk_ref, dsdec_ref):
    ch = _Chunk(C, block)
    c, h, b = ch.c, ch.h, ch.b
    rows = pl.ds(c * C, C)

    def put_c(ref):
      def put(i, x):
        ref[b, h, rows, ch.cols(i)] = x.astype(ref.dtype)
      return put

    def put_dAqk(x):
      dAqk_ref[b, h, rows, :] = x.astype(dAqk_ref.dtype)

    put = tiles.Prep(W=put_c(dW_ref), U=None, qg=put_c(dqg_ref), kd=put_c(dkd_ref), Aqk=put_dAqk,
                     sdec=ch.put_per_chunk(dsdec_ref))
    state_rows = lambda ref: tiles.Cols(K // block, lambda i: ref[b, h, c, ch.cols(i), :])
    tiles.state_grads(state_rows(S_ref), state_rows(dSn_ref), dO_ref[b, rows, h, :], dVp_ref[b, h, rows, :],
                      Vp_ref[b, h, rows, :], prec, put)

  sd = lambda *shape: jax.ShapeDtypeStruct(shape, store_dtype)
  out_shape = (sd(B, H, T, K), sd(B, H, T, K), sd(B, H, T, K), sd(B, H, T, C),
               jax.ShapeDtypeStruct((B, H, N, K), jnp.float32))
  return launch(kernel, grid=(N, H, B), out_shape=out_shape, interpret=interpret, tuning=tuning,
                name="kda_state_grads")(states, dS_next, dO, dVp, Vp)


def prep_backward(q, k, v, g, beta, doc, dW, dU, dqg, dkd, dAqk, dsdec, *, chunk: int, block: int,
                  scale: float, prec: tiles.Precision, interpret: bool, tuning: Tuning):
  """Returns dq, dk, dv, dg, dbeta in the layouts and dtypes of q, k, v, g, beta.

  dW, dqg, dkd [B,H,T,K], dU [B,H,T,V], dAqk [B,H,T,C], dsdec [B,H,N,K]: cotangents of prep_forward.
  """
  B, T, H, K = q.shape
  C, N = chunk, T // chunk

  def kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref, dW_ref, dU_ref, dqg_ref, dkd_ref, dAqk_ref,
             dsdec_ref, dq_ref, dk_ref, dv_ref, dg_ref, db_ref):
    ch = _Chunk(C, block)
    c, h, b = ch.c, ch.h, ch.b
    blocks = tiles.Tiles(ch.P, ch.P, lambda p, r: dAqk_ref[b, h, _rows(c, C, p), pl.ds(r * TILE, TILE)])
    d = tiles.Prep(W=ch.bhtx(dW_ref), U=ch.bhtx(dU_ref), qg=ch.bhtx(dqg_ref), kd=ch.bhtx(dkd_ref),
                   Aqk=blocks, sdec=tiles.Cols(K // block, lambda i: dsdec_ref[b, h, c, ch.cols(i)]))

    def put_db(p, x):
      db_ref[b, _rows(c, C, p), h] = x.astype(db_ref.dtype)

    put = tiles.Grads(q=ch.put_btx(dq_ref), k=ch.put_btx(dk_ref), v=ch.put_btx(dv_ref), g=ch.put_btx(dg_ref),
                      b=put_db)
    tiles.prep_vjp(*ch.inputs(q_ref, k_ref, v_ref, g_ref, beta_ref, doc_ref), scale, prec, d, put)

  like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  return launch(kernel, grid=(N, H, B), out_shape=tuple(like(x) for x in (q, k, v, g, beta)),
                interpret=interpret, tuning=tuning, name="kda_prep_bwd")(
                    q, k, v, g, beta, doc, dW, dU, dqg, dkd, dAqk, dsdec)
