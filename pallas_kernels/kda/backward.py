"""The backward KDA kernels, parallel over chunks, and their per-chunk math.

state_grads:   states, their cotangents, dO, dV', V' -> dW, dqg, dkd, dA_qk, dsdec (`chunk_state_grads`).
prep_backward: those cotangents and the forward's solve -> dq, dk, dv, dg, dbeta (`prep_vjp`).

Layouts as in forward.py: q, k [B,T,H,K], v [B,T,H,V], beta [B,T,H], g [B,T,H,K], row codes [B,T];
per-chunk operands [B,H,T,*], sdec [B,H,N,K], states [B,H,N,K,V]. prep_backward's extra [B,H,T,C]
float32 outputs serve as its programs' scratch (tiles.Scratch).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.kda.lowering import Tuning, dot, dot_nt, dot_tn, launch
from pallas_kernels.kda.tiles import (
  TILE,
  Chunk,
  Gates,
  Precision,
  Program,
  Rows,
  Scratch,
  docs,
  f32,
  from_anchor,
  full_mask,
  iota,
  loop,
  scratch_shapes,
)


def _colsum(x):
  return jnp.sum(x, axis=0)


def _to_anchor(G, Ga, t, C):
  """e^{G_i - G_a} for column strip t's anchor a (its first row) and rows i from a on, else 0."""
  return jnp.exp(jnp.where(iota((C, 1), 0) >= t * TILE, G - Ga[None, :], -jnp.inf))


class Prep(NamedTuple):
  """Cotangents of one chunk's prep results (forward.prep), as the state_grads kernel's sinks or
  prep_vjp's sources: W, qg, kd [C,BK] and sdec [BK] by K block, U [C,BK] by V block, Aqk [C,C]."""
  W: Any
  U: Any
  qg: Any
  kd: Any
  Aqk: Any
  sdec: Any


class Cols(NamedTuple):
  n: int
  get: Callable[[int], Any]             # i -> block i


def chunk_state_grads(S: Cols, dSn: Cols, dO_CV, dVp_CV, Vp_CV, prec: Precision, put: Prep):
  """Cotangents of one chunk's Prep (except dU = dV') from the state pass.

  S and dSn: the incoming state and the cotangent of the outgoing one, as [BK,V] row blocks.
  With V' = U - W S, O = qg S + A_qk V', S_next = sdec * S + kd^T V':
    dW = -dV' S^T, dqg = dO S^T, dA_qk = dO V'^T, dkd = V' dS_next^T, dsdec = rowsum(S * dS_next).
  Sinks here take (i, [C,BK]) and Aqk takes the [C,C] value.
  """
  put.Aqk(dot_nt(dO_CV, Vp_CV, prec.big))

  def block(i, carry):
    S_BV, dSn_BV = S.get(i), dSn.get(i)
    put.W(i, -dot_nt(dVp_CV, S_BV, prec.big))
    put.qg(i, dot_nt(dO_CV, S_BV, prec.big))
    put.kd(i, dot_nt(Vp_CV, dSn_BV, prec.big))
    put.sdec(i, jnp.sum(f32(S_BV) * f32(dSn_BV), axis=1))
    return carry

  loop(S.n, block, 0)


class Grads(NamedTuple):
  """Sinks: dq, dk, dg by (16-row tile, K block), dv [C,BK] by V block, db [C]."""
  q: Callable
  k: Callable
  v: Callable
  g: Callable
  b: Callable


def _tile_docs(code: Rows, P: int):
  """Per 16-row tile: (doc [16], reset [16,1], doc of its last row)."""
  out = []
  for p in range(P):
    c = code.tile(p)
    out.append((c // 2, (c % 2 == 1)[:, None], jnp.max(c // 2)))
  return out


def _route_to_gates(tile_docs, dG: list, dGC, prec_exact: str):
  """dg_i = sum of dG_j over later rows j of i's own document (+ dG_C for the last document).

  G of a document that starts inside the chunk sums only that document's gates after its first row, so
  nothing crosses a document boundary and the gate at a document start gets no gradient (it decays a
  state that was reset). Tiles from the last; `after` holds what rows beyond the tile owe to the
  document of the tile's last row.
  """
  P = len(dG)
  rows, cols = iota((TILE, TILE), 0), iota((TILE, TILE), 1)
  dg = [None] * P
  after = dGC
  for p in reversed(range(P)):
    doc, reset, last = tile_docs[p]
    same_later = ((cols >= rows) & (doc[:, None] == doc[None, :])).astype(jnp.float32)
    dg_p = dot(same_later, dG[p], prec_exact) + jnp.where((doc == last)[:, None], after[None, :], 0.0)
    dg[p] = jnp.where(reset, 0.0, dg_p)
    if p:
      prev_last = tile_docs[p - 1][2]
      after = (_colsum(jnp.where((doc == prev_last)[:, None], dG[p], 0.0))
               + jnp.where(prev_last == last, after, 0.0))
  return dg


def prep_vjp(q: Chunk, k: Chunk, v: Chunk, g: Gates, b: Rows, code: Rows, scale: float, prec: Precision,
             d: Prep, scratch: Scratch, put: Grads):
  """Cotangents of (q, k, v, g, b) from those of prep's outputs (d: sources by whole column block,
  d.Aqk() -> the whole [C,C]). The forward pass's solve comes in the scratch: "A" (strict S_kk, not
  scaled by b) and "L" (Linv), as forward.prep keeps them, so it is not recomputed.

  Hand-derived so that it stays dots and element-wise math:
    dR = Linv^T dWU,  dA_kk = -mask(dR WU^T),  and for S[i,j] = sum_d x_id y_jd e^{G_id - G_jd}
    dG = x * dx - y * dy, which avoids differentiating the decay factors one by one.
  """
  dm = docs(code)
  Linv = scratch.full("L")
  C = Linv.shape[0]
  P = C // TILE
  b_C1 = f32(b.full())[:, None]
  dWc = lambda i: jnp.where(dm.carried, f32(d.W.full(i)), 0.0)

  # Through W = Linv (b k e^G) (carried rows) and U = Linv (b v): dA_kk and the direct parts of db.
  def k_block(i, carry):
    acc, db = carry
    kg = f32(k.full(i)) * jnp.exp(g.block(i).full())
    dR = dot_tn(Linv, dWc(i), prec.solve)
    acc = acc + dot_nt(dR, dot(Linv, b_C1 * kg, prec.solve), prec.solve)
    return acc, db + jnp.sum(dR * kg, axis=1)

  def v_block(i, carry):
    acc, db = carry
    vf = f32(v.full(i))
    dR = dot_tn(Linv, f32(d.U.full(i)), prec.solve)
    put.v(i, b_C1 * dR)
    acc = acc + dot_nt(dR, dot(Linv, b_C1 * vf, prec.solve), prec.solve)
    return acc, db + jnp.sum(dR * vf, axis=1)

  carry = (jnp.zeros((C, C), jnp.float32), jnp.zeros((C,), jnp.float32))
  acc, db = loop(v.n, v_block, loop(k.n, k_block, carry))
  dA = -jnp.where(full_mask(dm, strict=True), acc, 0.0)
  put.b(db + jnp.sum(dA * scratch.full("A"), axis=1))
  scratch.put_full("K", b_C1 * dA)
  scratch.put_full("Q", jnp.where(full_mask(dm, strict=False), scale * f32(d.Aqk()), 0.0))
  scratch.barrier()
  tile_docs = _tile_docs(code, P)
  # The score cotangents' strips (Q: of A_qk, K: of A_kk) and Linv's, read once for every column block:
  # read inside the loop, prep_bwd measured slower at C=32 (H200).
  # Unrolling the loop over column blocks instead doubled the time: the kernel is short of registers,
  # so above C=32 (not measured; twice the strips, each twice as wide) they are read per block.
  read_once = P <= 2

  def strips(load):
    held = [load(t) for t in range(P)] if read_once else None
    return (lambda t: held[t]) if read_once else load

  dq_rows, dk_rows = strips(lambda t: scratch.rows("Q", t)), strips(lambda t: scratch.rows("K", t))
  dq_cols, dk_cols = strips(lambda t: scratch.cols("Q", t)), strips(lambda t: scratch.cols("K", t))
  linv_cols = strips(lambda t: scratch.cols("L", t))

  def g_block(i, carry):
    Gb = g.block(i)
    G = Gb.full()
    GC = Gb.row(C - 1)
    qf, kf = f32(q.full(i)), f32(k.full(i))
    dWf = dWc(i)
    # kd = k e^{G_C - G} (last document), sdec = e^{G_C} (whole chunk): their G_C part reaches every g.
    dkd_f = jnp.where(dm.in_last, f32(d.kd.full(i)) * jnp.exp(GC[None, :] - G), 0.0)
    dGC = _colsum(dkd_f * kf) + jnp.where(dm.whole, f32(d.sdec.get(i)) * jnp.exp(GC), 0.0)
    dG = []
    for t in range(P):
      Ga = Gb.row(t * TILE)
      # Row side of strip t: dx = (dP[t] @ k e^{G_a - G}) e^{G - G_a}.
      kc = kf * from_anchor(G, Ga, t, C)
      dqE = dot(dq_rows(t), kc, prec.dscore)
      dkE = dot(dk_rows(t), kc, prec.dscore)
      # Column side of strip t: dy = (dP[:,t]^T @ x e^{G - G_a}) e^{G_a - G}.
      xe = _to_anchor(G, Ga, t, C)
      G_t = Gb.tile(t)
      loc = G_t - Ga[None, :]
      dkc = (dot_tn(dq_cols(t), qf * xe, prec.dscore)
             + dot_tn(dk_cols(t), kf * xe, prec.dscore)) * jnp.exp(-loc)
      Erow = jnp.exp(loc)
      q_t, k_t = f32(q.tile(t, i)), f32(k.tile(t, i))
      eG_t = jnp.exp(G_t)
      dq = dqE * Erow
      dk_row = dkE * Erow
      dk_sol = f32(b.tile(t))[:, None] * dot_tn(linv_cols(t), dWf, prec.solve) * eG_t
      doc_t = tile_docs[t][0]
      dqg = jnp.where((doc_t == 0)[:, None], scale * f32(d.qg.tile(t, i)) * eG_t, 0.0)
      dkd = jnp.where((doc_t == dm.last)[:, None], f32(d.kd.tile(t, i)) * jnp.exp(GC[None, :] - G_t), 0.0)
      dG.append(dk_sol * k_t + q_t * dq + k_t * dk_row - k_t * dkc + dqg * q_t - dkd * k_t)
      put.q(t, i, dq + dqg)
      put.k(t, i, dk_sol + dk_row + dkc + dkd)
    for t, dg in enumerate(_route_to_gates(tile_docs, dG, dGC, "f32")):
      put.g(t, i, dg)
    return carry

  loop(k.n, g_block, 0)


def state_grads(states, dS_next, dO, dVp, Vp, *, block: int, prec: Precision, store_dtype,
                interpret: bool, tuning: Tuning):
  """Returns dW, dqg, dkd [B,H,T,K] and dAqk [B,H,T,C] in store_dtype, dsdec [B,H,N,K] float32.

  states, dS_next [B,H,N,K,V]: the state entering each chunk and the cotangent of the one leaving it;
  dO [B,T,H,V]; dVp, Vp [B,H,T,V].
  """
  B, H, N, K, V = states.shape
  T = dVp.shape[2]
  C = T // N

  def kernel(S_ref, dSn_ref, dO_ref, dVp_ref, Vp_ref, dW_ref, dqg_ref, dkd_ref, dAqk_ref, dsdec_ref):
    pr = Program(C, block, interpret)
    c, h, b = pr.c, pr.h, pr.b

    def put_dAqk(x):
      dAqk_ref[b, h, pr.rows(), :] = x.astype(dAqk_ref.dtype)

    put = Prep(W=pr.put_full(dW_ref), U=None, qg=pr.put_full(dqg_ref), kd=pr.put_full(dkd_ref),
               Aqk=put_dAqk, sdec=pr.put_per_chunk(dsdec_ref))
    state_rows = lambda ref: Cols(K // block, lambda i: ref[b, h, c, pr.cols(i), :])
    chunk_state_grads(state_rows(S_ref), state_rows(dSn_ref), dO_ref[b, pr.rows(), h, :],
                      dVp_ref[b, h, pr.rows(), :], Vp_ref[b, h, pr.rows(), :], prec, put)

  sd = lambda *shape: jax.ShapeDtypeStruct(shape, store_dtype)
  out_shape = (sd(B, H, T, K), sd(B, H, T, K), sd(B, H, T, K), sd(B, H, T, C),
               jax.ShapeDtypeStruct((B, H, N, K), jnp.float32))
  return launch(kernel, grid=(N, H, B), out_shape=out_shape, interpret=interpret, tuning=tuning,
                name="kda_state_grads")(states, dS_next, dO, dVp, Vp)


def prep_backward(q, k, v, g, beta, code, A, Linv, dW, dU, dqg, dkd, dAqk, dsdec, *, chunk: int,
                  block: int, scale: float, prec: Precision, interpret: bool, tuning: Tuning):
  """Returns dq, dk, dv, dg, dbeta in the layouts and dtypes of q, k, v, g, beta.

  A, Linv [B,H,T,C]: the forward pass's solve (prep_forward with keep_solve); reading them costs less
  than redoing the scores and the solve here (BENCHMARKS.md, "KDA kernel").
  dW, dqg, dkd [B,H,T,K], dU [B,H,T,V], dAqk [B,H,T,C], dsdec [B,H,N,K]: cotangents of prep_forward.
  """
  B, T, H, K = q.shape
  C, N = chunk, T // chunk

  def kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, code_ref, A_ref, L_ref, dW_ref, dU_ref, dqg_ref, dkd_ref,
             dAqk_ref, dsdec_ref, dq_ref, dk_ref, dv_ref, dg_ref, db_ref, Q_ref, K_ref):
    pr = Program(C, block, interpret)
    c, h, b = pr.c, pr.h, pr.b
    d = Prep(W=pr.bhtx(dW_ref), U=pr.bhtx(dU_ref), qg=pr.bhtx(dqg_ref), kd=pr.bhtx(dkd_ref),
             Aqk=lambda: dAqk_ref[b, h, pr.rows(), :],
             sdec=Cols(K // block, lambda i: dsdec_ref[b, h, c, pr.cols(i)]))

    def put_db(x):
      db_ref[b, pr.rows(), h] = x.astype(db_ref.dtype)

    put = Grads(q=pr.put_tile(dq_ref, "btx"), k=pr.put_tile(dk_ref, "btx"),
                v=pr.put_full(dv_ref, "btx"), g=pr.put_tile(dg_ref, "btx"), b=put_db)
    scratch = pr.scratch({"A": A_ref, "L": L_ref, "Q": Q_ref, "K": K_ref})
    prep_vjp(*pr.inputs(q_ref, k_ref, v_ref, g_ref, beta_ref, code_ref), scale, prec, d, scratch, put)

  like = lambda x, dtype=None: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype)
  out_shape = (like(q), like(k), like(v), like(g), like(beta)) + scratch_shapes(B, H, T, C, 2)
  return launch(kernel, grid=(N, H, B), out_shape=out_shape, interpret=interpret, tuning=tuning,
                name="kda_prep_bwd")(q, k, v, g, beta, code, A, Linv, dW, dU, dqg, dkd, dAqk, dsdec)[:5]
