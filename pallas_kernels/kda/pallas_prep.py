"""The chunk-parallel KDA kernels: one program per (chunk, head, batch row).

prep_forward:  inputs -> W, U, qg, kd, A_qk, sdec for the state pass (pallas_tiles_fwd.prep), and for
               training the solve (strict S_kk, Linv) for prep_backward.
state_grads:   states, their cotangents, dO, dV', V' -> dW, dqg, dkd, dA_qk, dsdec (pallas_tiles.state_grads).
prep_backward: those cotangents and the solve -> dq, dk, dv, dg, dbeta (pallas_tiles.prep_vjp).

Layouts: q, k [B,T,H,K], v [B,T,H,V], beta [B,T,H] as the caller gives them (T padded to a whole number
of chunks), the log-decays g [B,T,H,K] (bf16 or float32; the kernels take its in-chunk cumsum G
themselves), row codes [B,T]; per-chunk results [B,H,T,*] so the sequential pass reads contiguous
tiles; sdec [B,H,N,K]; states [B,H,N,K,V]. prep_backward's extra [B,H,T,C] float32 outputs serve as
its programs' scratch.
"""

import copy

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import pallas_tiles as tiles
from pallas_kernels.kda import pallas_tiles_fwd as tiles_fwd
from pallas_kernels.kda.pallas_backend import Tuning, barrier, launch

TILE = tiles.TILE


class _Program:
  """Views of one program's chunk c, head h, batch row b."""

  def __init__(self, C, block, interpret):
    self.c, self.h, self.b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    self.C, self.block, self.interpret = C, block, interpret

  def at_chunk(self, c) -> "_Program":
    """The same program's views of chunk c instead."""
    other = copy.copy(self)
    other.c = c
    return other

  def rows(self, p=None):
    return pl.ds(self.c * self.C, self.C) if p is None else pl.ds(self.c * self.C + p * TILE, TILE)

  def cols(self, i):
    return pl.ds(i * self.block, self.block)

  def btx(self, ref):
    """A [B,T,H,X] operand."""
    return tiles.Chunk(ref.shape[-1] // self.block,
                       lambda i: ref[self.b, self.rows(), self.h, self.cols(i)],
                       lambda p, i: ref[self.b, self.rows(p), self.h, self.cols(i)])

  def bhtx(self, ref):
    """A [B,H,T,X] operand."""
    return tiles.Chunk(ref.shape[-1] // self.block,
                       lambda i: ref[self.b, self.h, self.rows(), self.cols(i)],
                       lambda p, i: ref[self.b, self.h, self.rows(p), self.cols(i)])

  def bt_rows(self, ref, with_head=True):
    if with_head:
      return tiles.Rows(lambda: ref[self.b, self.rows(), self.h], lambda p: ref[self.b, self.rows(p), self.h])
    return tiles.Rows(lambda: ref[self.b, self.rows()], lambda p: ref[self.b, self.rows(p)])

  def put_full(self, ref, layout="bhtx"):
    def put(i, x):
      if layout == "bhtx":
        ref[self.b, self.h, self.rows(), self.cols(i)] = x.astype(ref.dtype)
      else:
        ref[self.b, self.rows(), self.h, self.cols(i)] = x.astype(ref.dtype)
    return put

  def put_tile(self, ref, layout="bhtx"):
    """Sink of (16-row tile p, column block i) of a [B,H,T,X] (or [B,T,H,X]) ref."""
    def put(p, i, x):
      if layout == "bhtx":
        ref[self.b, self.h, self.rows(p), self.cols(i)] = x.astype(ref.dtype)
      else:
        ref[self.b, self.rows(p), self.h, self.cols(i)] = x.astype(ref.dtype)
    return put

  def put_square(self, ref):
    """Sink of the [C,C] block of a [B,H,T,C] ref."""
    def put(x):
      ref[self.b, self.h, self.rows(), :] = x.astype(ref.dtype)
    return put

  def put_per_chunk(self, ref):
    """Sink of [BK] blocks of a [B,H,N,K] ref."""
    def put(i, x):
      ref[self.b, self.h, self.c, self.cols(i)] = x.astype(ref.dtype)
    return put

  def scratch(self, refs: dict):
    b, h = self.b, self.h

    def put_full(name, x):
      refs[name][b, h, self.rows(), :] = x

    return tiles.Scratch(
        put_full=put_full,
        full=lambda name: refs[name][b, h, self.rows(), :],
        rows=lambda name, p: refs[name][b, h, self.rows(p), :],
        cols=lambda name, t: refs[name][b, h, self.rows(), pl.ds(t * TILE, TILE)],
        barrier=lambda: barrier(self.interpret))

  def inputs(self, q_ref, k_ref, v_ref, g_ref, beta_ref, code_ref):
    g = self.btx(g_ref)
    return (self.btx(q_ref), self.btx(k_ref), self.btx(v_ref), tiles.gate_cumsum(g),
            self.bt_rows(beta_ref), self.bt_rows(code_ref, with_head=False))


def _scratch_shapes(B, H, T, C, n):
  return tuple(jax.ShapeDtypeStruct((B, H, T, C), jnp.float32) for _ in range(n))


def prep_forward(q, k, v, g, beta, code, *, chunk: int, block: int, scale: float, prec: tiles.Precision,
                 store_dtype, interpret: bool, tuning: Tuning, keep_solve: bool = False,
                 merge_pairs: bool = False):
  """Returns W, U, qg, kd, Aqk, sdec: [B,H,T,K|V|K|K|C] in store_dtype and [B,H,N,K] float32; with
  keep_solve also the solve that prep_backward needs: strict S_kk and Linv, [B,H,T,C] float32 each.

  merge_pairs (N even, no keep_solve): a program preps chunks 2p and 2p+1 and merges them into one chunk
  of 2C rows (pallas_tiles_fwd.merge_pair); Aqk is then [B,H,T,2C] and sdec [B,H,N/2,K], the operands
  of a state pass at chunk 2C."""
  if merge_pairs:
    return _prep_forward_pairs(q, k, v, g, beta, code, chunk=chunk, block=block, scale=scale, prec=prec,
                               store_dtype=store_dtype, interpret=interpret, tuning=tuning)
  B, T, H, K = q.shape
  V = v.shape[-1]
  C, N = chunk, T // chunk

  def kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, code_ref, W_ref, U_ref, qg_ref, kd_ref, Aqk_ref,
             sdec_ref, *solve_refs):
    pr = _Program(C, block, interpret)
    A_put, Linv_put = (pr.put_square(ref) for ref in solve_refs) if keep_solve else (None, None)
    put = tiles_fwd.Sinks(W=pr.put_full(W_ref), U=pr.put_full(U_ref), qg=pr.put_full(qg_ref),
                          kd=pr.put_full(kd_ref), sdec=pr.put_per_chunk(sdec_ref), Aqk=pr.put_square(Aqk_ref),
                          A=A_put, Linv=Linv_put)
    tiles_fwd.prep(*pr.inputs(q_ref, k_ref, v_ref, g_ref, beta_ref, code_ref), scale, prec, put)

  sd = lambda *shape: jax.ShapeDtypeStruct(shape, store_dtype)
  out_shape = (sd(B, H, T, K), sd(B, H, T, V), sd(B, H, T, K), sd(B, H, T, K), sd(B, H, T, C),
               jax.ShapeDtypeStruct((B, H, N, K), jnp.float32))
  if keep_solve:
    out_shape += _scratch_shapes(B, H, T, C, 2)
  return launch(kernel, grid=(N, H, B), out_shape=out_shape, interpret=interpret, tuning=tuning,
                name="kda_prep_fwd")(q, k, v, g, beta, code)


def _prep_forward_pairs(q, k, v, g, beta, code, *, chunk: int, block: int, scale: float,
                        prec: tiles.Precision, store_dtype, interpret: bool, tuning: Tuning):
  """prep_forward with merge_pairs: one program per pair of chunks. Each chunk's prep writes its
  results where the merged chunk's go; the merge then reads them back (fresh in the cache) and
  rewrites the ones that change. The chunks' own decays go to a scratch output."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  C, N = chunk, T // chunk
  if N % 2:
    raise ValueError(f"merging chunk pairs needs an even number of chunks, got {N} (T={T}, chunk={C})")

  def kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, code_ref, W_ref, U_ref, qg_ref, kd_ref, Aqk_ref,
             sdec2_ref, sdec_ref):
    program = _Program(C, block, interpret)
    pair = program.c
    halves = [program.at_chunk(2 * pair + half) for half in (0, 1)]
    refs = {"W": W_ref, "U": U_ref, "qg": qg_ref, "kd": kd_ref}

    def prep_half(half, carry):
      # A loop rather than two inlined copies of prep, which ptxas (H200, chunk 32, K=V=128) compiled
      # with 276 bytes of spills; as a loop, none.
      pr = program.at_chunk(2 * pair + half)

      def put_Aqk(x):
        Aqk_ref[pr.b, pr.h, pr.rows(), pl.ds(half * C, C)] = x.astype(Aqk_ref.dtype)

      put = tiles_fwd.Sinks(W=pr.put_full(W_ref), U=pr.put_full(U_ref), qg=pr.put_full(qg_ref),
                            kd=pr.put_full(kd_ref), sdec=pr.put_per_chunk(sdec_ref), Aqk=put_Aqk)
      tiles_fwd.prep(*pr.inputs(q_ref, k_ref, v_ref, g_ref, beta_ref, code_ref), scale, prec, put)
      return carry

    jax.lax.fori_loop(0, 2, prep_half, 0)
    barrier(interpret)  # the merge reads what other threads of the program wrote

    def load(name, half, i):
      pr = halves[half]
      return refs[name][pr.b, pr.h, pr.rows(), pr.cols(i)].astype(jnp.float32)

    def store(name, half, i, x):
      pr = halves[half]
      refs[name][pr.b, pr.h, pr.rows(), pr.cols(i)] = x.astype(refs[name].dtype)

    def sdec(half, i):
      pr = halves[half]
      return sdec_ref[pr.b, pr.h, pr.c, pr.cols(i)]

    def put_sdec(i, x):
      pr = halves[0]
      sdec2_ref[pr.b, pr.h, pair, pr.cols(i)] = x

    def put_Aqk(half, col_half, x):
      pr = halves[half]
      Aqk_ref[pr.b, pr.h, pr.rows(), pl.ds(col_half * C, C)] = x.astype(Aqk_ref.dtype)

    views = tiles_fwd.PairViews(load=load, store=store, sdec=sdec, put_sdec=put_sdec, put_Aqk=put_Aqk,
                                barrier=lambda: barrier(interpret))
    tiles_fwd.merge_pair(views, K // block, V // block, C, prec)

  sd = lambda *shape: jax.ShapeDtypeStruct(shape, store_dtype)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  out_shape = (sd(B, H, T, K), sd(B, H, T, V), sd(B, H, T, K), sd(B, H, T, K), sd(B, H, T, 2 * C),
               f32(B, H, N // 2, K), f32(B, H, N, K))
  return launch(kernel, grid=(N // 2, H, B), out_shape=out_shape, interpret=interpret, tuning=tuning,
                name="kda_prep_fwd_pairs")(q, k, v, g, beta, code)[:6]


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
    pr = _Program(C, block, interpret)
    c, h, b = pr.c, pr.h, pr.b

    def put_dAqk(x):
      dAqk_ref[b, h, pr.rows(), :] = x.astype(dAqk_ref.dtype)

    put = tiles.Prep(W=pr.put_full(dW_ref), U=None, qg=pr.put_full(dqg_ref), kd=pr.put_full(dkd_ref),
                     Aqk=put_dAqk, sdec=pr.put_per_chunk(dsdec_ref))
    state_rows = lambda ref: tiles.Cols(K // block, lambda i: ref[b, h, c, pr.cols(i), :])
    tiles.state_grads(state_rows(S_ref), state_rows(dSn_ref), dO_ref[b, pr.rows(), h, :],
                      dVp_ref[b, h, pr.rows(), :], Vp_ref[b, h, pr.rows(), :], prec, put)

  sd = lambda *shape: jax.ShapeDtypeStruct(shape, store_dtype)
  out_shape = (sd(B, H, T, K), sd(B, H, T, K), sd(B, H, T, K), sd(B, H, T, C),
               jax.ShapeDtypeStruct((B, H, N, K), jnp.float32))
  return launch(kernel, grid=(N, H, B), out_shape=out_shape, interpret=interpret, tuning=tuning,
                name="kda_state_grads")(states, dS_next, dO, dVp, Vp)


def prep_backward(q, k, v, g, beta, code, A, Linv, dW, dU, dqg, dkd, dAqk, dsdec, *, chunk: int,
                  block: int, scale: float, prec: tiles.Precision, interpret: bool, tuning: Tuning):
  """Returns dq, dk, dv, dg, dbeta in the layouts and dtypes of q, k, v, g, beta.

  A, Linv [B,H,T,C]: the forward pass's solve (prep_forward with keep_solve); reading them costs less
  than redoing the scores and the solve here (H200, B=2 T=8192 H=16: see BENCHMARKS.md "KDA kernel").
  dW, dqg, dkd [B,H,T,K], dU [B,H,T,V], dAqk [B,H,T,C], dsdec [B,H,N,K]: cotangents of prep_forward.
  """
  B, T, H, K = q.shape
  C, N = chunk, T // chunk

  def kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, code_ref, A_ref, L_ref, dW_ref, dU_ref, dqg_ref, dkd_ref,
             dAqk_ref, dsdec_ref, dq_ref, dk_ref, dv_ref, dg_ref, db_ref, Q_ref, K_ref):
    pr = _Program(C, block, interpret)
    c, h, b = pr.c, pr.h, pr.b
    d = tiles.Prep(W=pr.bhtx(dW_ref), U=pr.bhtx(dU_ref), qg=pr.bhtx(dqg_ref), kd=pr.bhtx(dkd_ref),
                   Aqk=lambda: dAqk_ref[b, h, pr.rows(), :],
                   sdec=tiles.Cols(K // block, lambda i: dsdec_ref[b, h, c, pr.cols(i)]))

    def put_db(x):
      db_ref[b, pr.rows(), h] = x.astype(db_ref.dtype)

    put = tiles.Grads(q=pr.put_tile(dq_ref, "btx"), k=pr.put_tile(dk_ref, "btx"),
                      v=pr.put_full(dv_ref, "btx"), g=pr.put_tile(dg_ref, "btx"), b=put_db)
    scratch = pr.scratch({"A": A_ref, "L": L_ref, "Q": Q_ref, "K": K_ref})
    tiles.prep_vjp(*pr.inputs(q_ref, k_ref, v_ref, g_ref, beta_ref, code_ref), scale, prec, d, scratch,
                   put)

  like = lambda x, dtype=None: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype)
  out_shape = (like(q), like(k), like(v), like(g), like(beta)) + _scratch_shapes(B, H, T, C, 2)
  return launch(kernel, grid=(N, H, B), out_shape=out_shape, interpret=interpret, tuning=tuning,
                name="kda_prep_bwd")(q, k, v, g, beta, code, A, Linv, dW, dU, dqg, dkd, dAqk, dsdec)[:5]
