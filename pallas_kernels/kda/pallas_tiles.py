"""Per-chunk KDA math shared by the Pallas kernels, and the backward pass's (DESIGN §2 "Chunked form");
the forward prep's is in pallas_tiles_fwd.

One chunk of C = P * 16 rows: q, k [C,K], v [C,V], b [C], G [C,K] the in-chunk inclusive cumsum of the
log-decays g (float32, made from g inside the kernels by `gate_cumsum`), and a row code [C] int32 =
2 * doc + reset, doc the index of the row's document inside the chunk (0 = the document the incoming
state belongs to) and reset whether a document starts at that row. Operands are read by column block
i, either whole (`full(i)` -> [C,BK]) or as a 16-row tile (`tile(p, i)` -> [16,BK]); column blocks are
walked by loops.
Triton values cannot be sliced or concatenated, so the backward's [C,C] work matrices, built whole and
used by 16-row strips and columns, go through a global-memory `Scratch` of the same program, with a
barrier between writing and reading.

Scores by 16-row strip p, anchored on the strip's first row a:
  S[i,j] = sum_d (x_id e^{G_id - G_ad}) (k_jd e^{G_ad - G_jd}),  j up to the end of strip p.
With g >= -5 both exponents are within [-75, 75] on the diagonal tile and <= 0 before it, so every
strip is one dense dot; columns after the strip are cut before the exp. The anchor is the first row
because a later one would make a row's score depend on gates after it. The VJP's column side uses the
column strip's first row as anchor, so its factors are bounded the same way.
The forward's (I + A_kk)^{-1} comes by doubling (X - X A_s X, A_s the lower-left part of each 2s
block, s = 1, 2, .. C/2): blocked forward substitution, stable where a Neumann series is not.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.kda.pallas_backend import dot, dot_nt, dot_tn

TILE = 16


class Precision(NamedTuple):
  """Dot precision per role, see pallas_backend.dot: "bf16", "tf32" or "f32"."""
  big: str     # scores, state products, state gradients: the bulk of the FLOPs
  solve: str   # the triangular solve
  dscore: str  # score cotangents to q, k and g: dg sums them over the chunk, where they nearly cancel


def precision_for(dtype) -> Precision:
  """bf16 data: bf16 operands, tf32 for the solve and the score cotangents. float32: exact float32."""
  return (Precision("bf16", "tf32", "tf32") if jnp.dtype(dtype) == jnp.bfloat16
          else Precision("f32", "f32", "f32"))


class Chunk(NamedTuple):
  """One operand of one chunk: n column blocks, full(i) -> [C,BK], tile(p, i) -> rows 16p.., [16,BK]."""
  n: int
  full: Callable
  tile: Callable


class Rows(NamedTuple):
  """A per-row vector of one chunk: full() -> [C], tile(p) -> [16]."""
  full: Callable
  tile: Callable


class Scratch(NamedTuple):
  """[C,C] float32 work matrices in global memory, by name; `barrier` orders writes before reads."""
  put_full: Callable   # (name, [C,C])
  full: Callable       # name -> [C,C]
  rows: Callable       # (name, p) -> [16,C]
  cols: Callable       # (name, t) -> [C,16]
  barrier: Callable


def f32(x):
  return x.astype(jnp.float32)


def loop(n: int, body, carry):
  """body(i, carry) over column blocks: a real loop, so the kernel's size does not grow with K / BK."""
  if n == 1:
    return body(0, carry)
  return jax.lax.fori_loop(0, n, body, carry)


def iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _colsum(x):
  return jnp.sum(x, axis=0)


class Docs(NamedTuple):
  doc: Any       # [C] document index in the chunk
  last: Any      # index of the chunk's last document
  carried: Any   # [C,1] row continues the incoming state's document
  in_last: Any   # [C,1] row is in the chunk's last document (feeds the next state)
  whole: Any     # the whole chunk continues the incoming document


def docs(code: Rows) -> Docs:
  doc = code.full() // 2
  last = jnp.max(doc)
  return Docs(doc, last, (doc == 0)[:, None], (doc == last)[:, None], last == 0)


def full_mask(dm: Docs, strict: bool):
  C = dm.doc.shape[0]
  i, j = iota((C, C), 0), iota((C, C), 1)
  same = dm.doc[:, None] == dm.doc[None, :]
  return same & ((j < i) if strict else (j <= i))


def from_anchor(G, Ga, p, C):
  """e^{G_a - G_j} for strip p's anchor a and rows j up to the end of the strip, else 0."""
  return jnp.exp(jnp.where(iota((C, 1), 0) < (p + 1) * TILE, Ga[None, :] - G, -jnp.inf))


def _to_anchor(G, Ga, t, C):
  """e^{G_i - G_a} for column strip t's anchor a (its first row) and rows i from a on, else 0."""
  return jnp.exp(jnp.where(iota((C, 1), 0) >= t * TILE, G - Ga[None, :], -jnp.inf))


def take_row(x, r: int):
  """Row r of x [n,BK], by a masked max (Triton values cannot be indexed). Taken out of x itself, it
  cancels exactly against x's own row r."""
  return jnp.max(jnp.where(iota((x.shape[0], 1), 0) == r, x, -jnp.inf), axis=0)


def _bf16_parts(g):
  """g as bf16 parts whose sum is g exactly: itself if bf16, else three (8 + 8 + 8 significant bits)."""
  if g.dtype == jnp.bfloat16:
    return (g,)
  g = f32(g)
  hi = g.astype(jnp.bfloat16)
  rest = g - f32(hi)
  mid = rest.astype(jnp.bfloat16)
  return hi, mid, (rest - f32(mid)).astype(jnp.bfloat16)


class GateBlock:
  """G of one column block, from the gates g [C,BK] (bf16 or float32) of the chunk.

  Prefix sums are dots with lower-triangular 0/1 matrices, exact bf16 operands, float32 accumulation:
  exact but for the order of the additions. Each tile is made at most once per block. A row comes out
  of its own tile by a masked max, so a strip's anchor cancels exactly against its own row (rows made
  by another sum order put float32 rounding of |G| <= 5 C into every decay factor).
  """

  def __init__(self, g):
    self.C = g.shape[0]
    self._parts = _bf16_parts(g)
    self._tiles = {}
    self._full = None

  def _sums(self, rows: int, first: int):
    lower = (first + iota((rows, self.C), 0) >= iota((rows, self.C), 1)).astype(jnp.bfloat16)
    out = dot(lower, self._parts[0], "bf16")
    for part in self._parts[1:]:
      out = out + dot(lower, part, "bf16")
    return out

  def full(self):
    """[C,BK]."""
    if self._full is None:
      self._full = self._sums(self.C, 0)
    return self._full

  def tile(self, p: int):
    """Rows 16p.., [16,BK]."""
    if p not in self._tiles:
      self._tiles[p] = self._sums(TILE, p * TILE)
    return self._tiles[p]

  def row(self, r: int):
    """Row r, [BK]."""
    return take_row(self.tile(r // TILE), r % TILE)


class Gates(NamedTuple):
  """The G operand of one chunk: n column blocks, block(i) -> GateBlock (make it once per loop step)."""
  n: int
  block: Callable


def gate_cumsum(gates: Chunk) -> Gates:
  """G from the gates' operand, inside the kernel, so that no [B,T,H,K] float32 G is written and read
  between the kernels (XLA's cumsum did that once per pass)."""
  return Gates(gates.n, lambda i: GateBlock(gates.full(i)))


def inverse(A, prec: Precision):
  """(I + A)^{-1} for a strictly lower-triangular [n,n] A, n a power of two, by doubling (see the module
  docstring): from X, the inverse of the s x s diagonal blocks, to that of the 2s x 2s ones."""
  n = A.shape[0]
  rows, cols = iota((n, n), 0), iota((n, n), 1)
  lower_left = lambda s: (rows // (2 * s) == cols // (2 * s)) & (rows % (2 * s) >= s) & (cols % (2 * s) < s)
  # s = 1 from X = I is I - A_1: no dots (two of the chain's dependent dots; -2.5% of the forward prep
  # kernel at B=1 T=131072 H=16 on an H100, session 30).
  X = (rows == cols).astype(jnp.float32) - jnp.where(lower_left(1), A, 0.0)
  s = 2
  while s < n:
    X = X - dot(dot(X, jnp.where(lower_left(s), A, 0.0), prec.solve), X, prec.solve)
    s *= 2
  return X


class Prep(NamedTuple):
  """Cotangents of one chunk's prep results (pallas_tiles_fwd.prep), as state_grads' sinks or
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


def state_grads(S: Cols, dSn: Cols, dO_CV, dVp_CV, Vp_CV, prec: Precision, put: Prep):
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
  scaled by b) and "L" (Linv), as pallas_tiles_fwd.prep keeps them, so it is not recomputed.

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
  # read inside the loop, prep_bwd took 2.011 ms against 1.936 at C=32, B=2 T=8192 H=16 on the H200.
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
