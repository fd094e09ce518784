"""Per-chunk KDA forward math for the Pallas prep kernel, by 16x16 blocks (DESIGN §2 "Chunked form").

The [C,C] score and solve matrices are held as their lower-triangular 16x16 blocks (p, r), r <= p,
each its own value, so nothing is sliced or concatenated and no block goes through global memory
between being made and being used (the backward's prep_vjp, which needs whole strips and columns of
them, reads what this writes). With P = C / 16 there are P(P+1)/2 blocks per matrix: 3 at C=32, 10
at C=64, 36 at C=128.

Scores of block (p, r), anchored on strip p's first row a as in pallas_tiles:
  S[i,j] = sum_d (x_id e^{G_id - G_ad}) (k_jd e^{G_ad - G_jd}),  i in strip p, j in strip r <= p.
Solve: Linv = (I + A)^{-1}, A = b * strict(S_kk), by blocked forward substitution:
  Linv_pp = (I + A_pp)^{-1} (pallas_tiles' 16x16 doubling),
  Linv_pr = -Linv_pp sum_{r <= s < p} A_ps Linv_sr.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

from pallas_kernels.kda.pallas_backend import dot, dot_nt
from pallas_kernels.kda.pallas_tiles import (
  TILE,
  Chunk,
  Gates,
  Precision,
  Rows,
  docs,
  f32,
  inverse16,
  iota,
  loop,
)


class Sinks(NamedTuple):
  """Where prep puts one chunk's results (scale folded into qg and Aqk):
  W, qg, kd (p, i, [16,BK]) and U (p, i, [16,BV]) by 16-row tile and column block; sdec(i, [BK]) by K
  block; Aqk(p, r, [16,16]) by block, the upper ones zero; and, to keep the solve
  for the backward pass, A (strict S_kk) and Linv the same way (None: not kept)."""
  W: Callable
  U: Callable
  qg: Callable
  kd: Callable
  sdec: Callable
  Aqk: Callable
  A: Any = None
  Linv: Any = None


def _pairs(P: int):
  return [(p, r) for p in range(P) for r in range(p + 1)]


def _block_mask(code: Rows, p: int, r: int, strict: bool):
  """[16,16]: entries (i in strip p, j in strip r) of the same document with j < i (strict) or j <= i."""
  i = p * TILE + iota((TILE, TILE), 0)
  j = r * TILE + iota((TILE, TILE), 1)
  same = (code.tile(p) // 2)[:, None] == (code.tile(r) // 2)[None, :]
  return same & ((j < i) if strict else (j <= i))


def score_blocks(q: Chunk, k: Chunk, g: Gates, P: int, prec: Precision):
  """Unmasked S_qk and S_kk as dicts {(p, r): [16,16]} over r <= p; g: the G operand."""
  pairs = _pairs(P)
  zero = jnp.zeros((TILE, TILE), jnp.float32)

  def body(i, acc):
    Sqk, Skk = list(acc[0]), list(acc[1])
    Gb = g.block(i)
    G = [Gb.tile(t) for t in range(P)]
    kt = [f32(k.tile(t, i)) for t in range(P)]
    for p in range(P):
      Ga = Gb.row(p * TILE)[None, :]
      Erow = jnp.exp(G[p] - Ga)
      k_row, q_row = kt[p] * Erow, f32(q.tile(p, i)) * Erow
      for r in range(p + 1):
        k_col = kt[r] * jnp.exp(Ga - G[r])
        n = pairs.index((p, r))
        Skk[n] = Skk[n] + dot_nt(k_row, k_col, prec.big)
        Sqk[n] = Sqk[n] + dot_nt(q_row, k_col, prec.big)
    return tuple(Sqk), tuple(Skk)

  Sqk, Skk = loop(k.n, body, ((zero,) * len(pairs), (zero,) * len(pairs)))
  return dict(zip(pairs, Sqk, strict=True)), dict(zip(pairs, Skk, strict=True))


def solve_blocks(A: dict, P: int, prec: Precision):
  """Blocks of (I + A)^{-1} for A given by its blocks {(p, r): [16,16]}, r <= p, strictly lower."""
  L = {}
  for p in range(P):
    L[p, p] = inverse16(A[p, p], prec)
    for r in range(p):
      acc = dot(A[p, r], L[r, r], prec.solve)
      for s in range(r + 1, p):
        acc = acc + dot(A[p, s], L[s, r], prec.solve)
      L[p, r] = -dot(L[p, p], acc, prec.solve)
  return L


def prep(q: Chunk, k: Chunk, v: Chunk, g: Gates, b: Rows, code: Rows, scale: float, prec: Precision,
         put: Sinks):
  """One chunk's W, U, qg, kd, A_qk, sdec (DESIGN §2), float32, handed to the sinks in `put`.
  g is the G operand (in-chunk cumsum of the gates)."""
  C = code.full().shape[0]
  P = C // TILE
  dm = docs(code)
  if g.n == 1:
    # One column block: the scores and W's right-hand sides share its G instead of making it twice
    # (with more blocks each pass is a loop, whose steps cannot hand values to the other's).
    only = g.block(0)
    g = g._replace(block=lambda i: only)
  Sqk, Skk = score_blocks(q, k, g, P, prec)
  zero = jnp.zeros((TILE, TILE), jnp.float32)
  A, bA = {}, {}
  for p, r in _pairs(P):
    A[p, r] = jnp.where(_block_mask(code, p, r, strict=True), Skk[p, r], 0.0)
    bA[p, r] = f32(b.tile(p))[:, None] * A[p, r]
  L = solve_blocks(bA, P, prec)
  for p in range(P):
    for r in range(P):
      lower = r <= p
      put.Aqk(p, r, jnp.where(_block_mask(code, p, r, strict=False), scale * Sqk[p, r], 0.0) if lower
              else zero)
      if put.Linv is not None:
        put.A(p, r, A[p, r] if lower else zero)
        put.Linv(p, r, L[p, r] if lower else zero)
  tile_doc = [code.tile(t) // 2 for t in range(P)]

  def solved(rhs, t):
    """Tile t of Linv @ rhs, rhs given by its tiles."""
    out = dot(L[t, 0], rhs[0], prec.solve)
    for r in range(1, t + 1):
      out = out + dot(L[t, r], rhs[r], prec.solve)
    return out

  def w_block(i, carry):
    Gb = g.block(i)
    GC = Gb.row(C - 1)
    put.sdec(i, jnp.where(dm.whole, jnp.exp(GC), 0.0))
    rhs = []
    for t in range(P):
      G_t, k_t = Gb.tile(t), f32(k.tile(t, i))
      eG_t = jnp.exp(G_t)
      put.qg(t, i, jnp.where((tile_doc[t] == 0)[:, None], scale * f32(q.tile(t, i)) * eG_t, 0.0))
      put.kd(t, i, jnp.where((tile_doc[t] == dm.last)[:, None], k_t * jnp.exp(GC[None, :] - G_t), 0.0))
      rhs.append(f32(b.tile(t))[:, None] * k_t * eG_t)
    for t in range(P):
      put.W(t, i, jnp.where((tile_doc[t] == 0)[:, None], solved(rhs, t), 0.0))
    return carry

  def u_block(i, carry):
    rhs = [f32(b.tile(t))[:, None] * f32(v.tile(t, i)) for t in range(P)]
    for t in range(P):
      put.U(t, i, solved(rhs, t))
    return carry

  loop(k.n, w_block, 0)
  loop(v.n, u_block, 0)
