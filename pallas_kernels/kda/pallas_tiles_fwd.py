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


class PairViews(NamedTuple):
  """A prep program's two chunks a (first) and b as the merge reads and rewrites them, in place:
  load(name, half, i) -> float32 [C, BK or BV] of W, U, qg or kd (half 0: a, 1: b; i: column block);
  store(name, half, i, x); sdec(half, i) -> float32 [BK]; put_sdec(i, x) the merged chunk's;
  put_Aqk(half, col_half, x) a [C, C] quarter of the merged chunk's [2C, 2C] A_qk; barrier() over the
  program's threads (a block loaded by some threads is rewritten by others)."""
  load: Callable
  store: Callable
  sdec: Callable
  put_sdec: Callable
  put_Aqk: Callable
  barrier: Callable


def merge_pair(views: PairViews, n_k: int, n_v: int, C: int, prec: Precision):
  """Rewrites the state-pass operands of chunks a and b (prep's, in place) as those of one chunk of
  2C rows, so that the state pass walks half as many chunks. With S the state entering a, each chunk's
  pass is V' = U - W S, O = qg S + A_qk V', S <- sdec * S + kd^T V'. Through b's entering state
  S_a = sdec_a * S + kd_a^T V'_a, and with M = W_b kd_a^T [C, C]:
    V'_b = (U_b - M U_a) - (W_b sdec_a - M W_a) S,
    O_b  = (qg_b sdec_a) S + (qg_b kd_a^T) V'_a + A_qk,b V'_b,
    S   <- (sdec_a sdec_b) * S + (kd_a sdec_b)^T V'_a + kd_b^T V'_b.
  So b's W, U and qg, a's kd, the decay and A_qk = [[A_qk,a, 0], [qg_b kd_a^T, A_qk,b]] change; a's W, U,
  qg and b's kd stay. Every factor is a decay over part of the pair, at most 1, so nothing here can
  grow, as within a chunk."""
  zero = jnp.zeros((C, C), jnp.float32)

  def cross(i, acc):
    M, Q = acc
    kd_a = views.load("kd", 0, i)
    return (M + dot_nt(views.load("W", 1, i), kd_a, prec.big),
            Q + dot_nt(views.load("qg", 1, i), kd_a, prec.big))

  M, Q = loop(n_k, cross, (zero, zero))
  views.put_Aqk(1, 0, Q)
  views.put_Aqk(0, 1, zero)
  views.barrier()  # every thread has read the blocks that the loops below rewrite

  def k_block(i, carry):
    s_a, s_b = views.sdec(0, i), views.sdec(1, i)
    W_b = views.load("W", 1, i) * s_a[None, :] - dot(M, views.load("W", 0, i), prec.solve)
    qg_b = views.load("qg", 1, i) * s_a[None, :]
    kd_a = views.load("kd", 0, i) * s_b[None, :]
    views.barrier()
    views.store("W", 1, i, W_b)
    views.store("qg", 1, i, qg_b)
    views.store("kd", 0, i, kd_a)
    views.put_sdec(i, s_a * s_b)
    return carry

  def v_block(i, carry):
    U_b = views.load("U", 1, i) - dot(M, views.load("U", 0, i), prec.solve)
    views.barrier()
    views.store("U", 1, i, U_b)
    return carry

  loop(n_k, k_block, 0)
  loop(n_v, v_block, 0)
