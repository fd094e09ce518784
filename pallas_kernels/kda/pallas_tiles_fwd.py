"""Per-chunk KDA forward math for the Pallas prep kernel, as whole-chunk dots (DESIGN §2 "Chunked form").

Every product is a [C,*] x [*,C] or [C,C] x [C,*] dot. The block-wise form this replaced, each 16x16
block of the scores and the solve its own dot, took 0.497 ms against this form's 0.469 at chunk 32 and
1.45-1.70 against 0.880 at chunk 64 on the H200 (BENCHMARKS.md, "KDA kernel"); at chunk 32 with
128 columns and 4 warps both use the 255 registers per thread that ptxas allows, so an SM holds 8 warps
of either.

Scores by 16-row strip p, anchored on the strip's first row a (pallas_tiles' docstring says why this is
bounded): with R = x e^{G - G_anchor(row)} made once for all rows, each row's own strip anchor,
  S = sum_p mask_p(R) (k e^{G_a(p) - G})^T,
mask_p keeping strip p's rows and the column factor cut after strip p before its exp. With the other
strips' rows zero, the score dots do P whole [C,C] products where the lower-triangular blocks need
(P + 1) / 2P of one. The zero rows meet every column factor of strip p, so those must be finite: the
gates' bound (g >= -5, e^{G_a - G_j} <= e^75) is what keeps 0 * inf out of the scores, not only what
keeps them accurate.
Solve: Linv = (I + A)^{-1}, A = b * strict(S_kk), by doubling over the whole chunk (pallas_tiles.inverse).
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
  from_anchor,
  full_mask,
  inverse,
  iota,
  loop,
  take_row,
)


class Sinks(NamedTuple):
  """Where prep puts one chunk's results (scale folded into qg and Aqk): W, qg, kd (i, [C,BK]) and U
  (i, [C,BV]) by column block; sdec (i, [BK]) by K block; Aqk ([C,C]), its upper part zero; and, to keep
  the solve for the backward pass, A (strict S_kk) and Linv ([C,C]; None: not kept)."""
  W: Callable
  U: Callable
  qg: Callable
  kd: Callable
  sdec: Callable
  Aqk: Callable
  A: Any = None
  Linv: Any = None


def anchored_rows(G, P: int):
  """(G - G_anchor(row), [G_a(p) for each strip p]): every row against its own strip's first row."""
  rows = iota((G.shape[0], 1), 0)
  anchors = [take_row(G, p * TILE) for p in range(P)]
  G_anchor = anchors[0][None, :]
  for p in range(1, P):
    G_anchor = jnp.where(rows >= p * TILE, anchors[p][None, :], G_anchor)
  return G - G_anchor, anchors


def scores(q: Chunk, k: Chunk, g: Gates, P: int, prec: Precision):
  """Unmasked S_qk and S_kk, [C,C] each (entries after a row's own strip are zero, the diagonal blocks'
  upper parts finite junk); g: the G operand."""
  C = P * TILE
  strip = iota((C, 1), 0) // TILE

  def body(i, acc):
    Sqk, Skk = acc
    G = g.block(i).full()
    loc, anchors = anchored_rows(G, P)
    E = jnp.exp(loc)
    kf = f32(k.full(i))
    k_row, q_row = kf * E, f32(q.full(i)) * E
    for p in range(P):
      k_col = kf * from_anchor(G, anchors[p], p, C)
      mine = strip == p
      Skk = Skk + dot_nt(jnp.where(mine, k_row, 0.0), k_col, prec.big)
      Sqk = Sqk + dot_nt(jnp.where(mine, q_row, 0.0), k_col, prec.big)
    return Sqk, Skk

  zero = jnp.zeros((C, C), jnp.float32)
  return loop(k.n, body, (zero, zero))


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
  Sqk, Skk = scores(q, k, g, P, prec)
  A = jnp.where(full_mask(dm, strict=True), Skk, 0.0)
  b_C1 = f32(b.full())[:, None]
  Linv = inverse(b_C1 * A, prec)
  put.Aqk(jnp.where(full_mask(dm, strict=False), scale * Sqk, 0.0))
  if put.Linv is not None:
    put.A(A)
    put.Linv(Linv)

  def w_block(i, carry):
    G = g.block(i).full()
    GC = take_row(G, C - 1)
    put.sdec(i, jnp.where(dm.whole, jnp.exp(GC), 0.0))
    kf, eG = f32(k.full(i)), jnp.exp(G)
    put.qg(i, jnp.where(dm.carried, scale * f32(q.full(i)) * eG, 0.0))
    put.kd(i, jnp.where(dm.in_last, kf * jnp.exp(GC[None, :] - G), 0.0))
    put.W(i, jnp.where(dm.carried, dot(Linv, b_C1 * kf * eG, prec.solve), 0.0))
    return carry

  def u_block(i, carry):
    put.U(i, dot(Linv, b_C1 * f32(v.full(i)), prec.solve))
    return carry

  loop(k.n, w_block, 0)
  loop(v.n, u_block, 0)
