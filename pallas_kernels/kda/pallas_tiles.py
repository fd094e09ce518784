"""Per-chunk KDA math on 16-row register tiles, shared by the Pallas kernels (DESIGN §2 "Chunked form").

One chunk of C = P * 16 rows: q, k, g [C,K], v [C,V], b [C], and a row code [C] int32: 2 * doc + reset,
doc the index of the row's document inside the chunk (0 = the document the incoming state belongs to)
and reset whether a document starts at that row. Operands arrive as tiles
(`Tiles.get(p, i)` -> rows 16p.., column block i, [16,BK]) and results leave through sinks
(put(p, i, tile)), so a kernel holds a few small tiles at a time and never slices a value (the Triton
side cannot). Per-channel quantities (G and the decay factors) are independent across column blocks;
only the 16x16 score blocks are summed over them; column blocks are walked by loops.

Scores: block (p, r), r <= p, anchored on row tile p's first row a:
  S[i,j] = sum_d (x_id e^{G_id - G_ad}) (k_jd e^{G_ad - G_jd}).
With g >= -5 both exponents are within [-75, 75] on the diagonal block (r = p) and <= 0 for r < p, so
every block is a dense dot; blocks r > p are never formed. The anchor is the first row because a later
one would make a row's score depend on gates after it.
Solve: (I + A_kk) is block lower-triangular; its 16x16 diagonal blocks are inverted by doubling and the
rest is block forward (and, for the VJP, transposed backward) substitution.
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


class Tiles(NamedTuple):
  P: int                                # row tiles
  n: int                                # column blocks
  get: Callable[[int, int], Any]        # (p, i) -> [16, BK]


class Rows(NamedTuple):
  get: Callable[[int], Any]             # p -> [16]


def _f32(x):
  return x.astype(jnp.float32)


def _loop(n: int, body, carry):
  """body(i, carry) over column blocks: a real loop, so the kernel's size does not grow with K / BK."""
  if n == 1:
    return body(0, carry)
  return jax.lax.fori_loop(0, n, body, carry)


def _iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _row(x, i):
  """Row i of a tile as [BK], by a masked sum (values cannot be sliced on the Triton side)."""
  return jnp.sum(jnp.where(_iota(x.shape, 0) == i, x, 0.0), axis=0)


def _colsum(x):
  return jnp.sum(x, axis=0)


class Docs(NamedTuple):
  doc: list          # per row tile [16] int32
  reset: list        # per row tile [16,1]: a document starts at this row (inside the chunk)
  carried: list      # per row tile [16,1]: row continues the incoming state's document
  last: list         # per row tile [16,1]: row is in the chunk's last document (feeds the next state)
  whole: Any         # the whole chunk continues the incoming document


def docs(code: Rows, P: int) -> Docs:
  """Row codes are 2 * doc + reset (see pallas_op)."""
  codes = [code.get(p) for p in range(P)]
  d = [c // 2 for c in codes]
  last = jnp.max(d[P - 1])
  return Docs(d, [(c % 2 == 1)[:, None] for c in codes], [(x == 0)[:, None] for x in d],
              [(x == last)[:, None] for x in d], last == 0)


def block_mask(dm: Docs, p: int, r: int, strict: bool):
  """Score block (p, r) entries that exist: same document, and causal on the diagonal block."""
  same = dm.doc[p][:, None] == dm.doc[r][None, :]
  if r < p:
    return same
  rows, cols = _iota((TILE, TILE), 0), _iota((TILE, TILE), 1)
  return same & ((cols < rows) if strict else (cols <= rows))


def gates(g: Tiles, i: int):
  """Per row tile: G (in-chunk inclusive cumsum of g) and its first row Ga; and G_C (last row)."""
  G, Ga = [], []
  prefix = None
  for p in range(g.P):
    G_p = jnp.cumsum(_f32(g.get(p, i)), axis=0)
    if prefix is not None:
      G_p = G_p + prefix[None, :]
    G.append(G_p)
    Ga.append(_row(G_p, 0))
    prefix = _row(G_p, TILE - 1)
  return G, Ga, prefix


def _decay(Ga_K, G):
  """e^{G_a - G_j} for row tile p's anchor a: within [1, e^75] on tile p itself, <= 1 on earlier tiles."""
  return jnp.exp(Ga_K[None, :] - G)


def scores(q: Tiles | None, k: Tiles, g: Tiles, prec: Precision):
  """Unmasked score blocks S_qk[p][r], S_kk[p][r] for r <= p (S_qk skipped when q is None)."""
  P = k.P
  zero = jnp.zeros((TILE, TILE), jnp.float32)

  def body(i, acc):
    Sqk, Skk = [list(x) for x in acc[0]], [list(x) for x in acc[1]]
    G, Ga, _ = gates(g, i)
    ks = [_f32(k.get(r, i)) for r in range(P)]
    for p in range(P):
      Erow = jnp.exp(G[p] - Ga[p][None, :])
      kE = ks[p] * Erow
      qE = None if q is None else _f32(q.get(p, i)) * Erow
      for r in range(p + 1):
        kc = ks[r] * _decay(Ga[p], G[r])
        Skk[p][r] = Skk[p][r] + dot_nt(kE, kc, prec.big)
        if q is not None:
          Sqk[p][r] = Sqk[p][r] + dot_nt(qE, kc, prec.big)
    return tuple(map(tuple, Sqk)), tuple(map(tuple, Skk))

  init = tuple(tuple([zero] * (p + 1)) for p in range(P))
  Sqk, Skk = _loop(k.n, body, (init, init))
  return Sqk, Skk


def _inverse16(A, prec: Precision):
  """(I + A)^{-1} for a strictly lower-triangular 16x16 A, by doubling the inverted diagonal blocks.

  With X the inverse of the s-blocks, the 2s-block inverse is X - X A_s X, A_s the lower-left s x s part
  of each 2s-block: the blocked forward substitution, stable where a Neumann series is not.
  """
  rows, cols = _iota((TILE, TILE), 0), _iota((TILE, TILE), 1)
  X = (rows == cols).astype(jnp.float32)
  s = 1
  while s < TILE:
    lower_left = (rows // (2 * s) == cols // (2 * s)) & (rows % (2 * s) >= s) & (cols % (2 * s) < s)
    X = X - dot(dot(X, jnp.where(lower_left, A, 0.0), prec.solve), X, prec.solve)
    s *= 2
  return X


class Solver(NamedTuple):
  """L = I + A_kk as 16x16 blocks A[p][r] (r < p) and diagonal-block inverses Dinv[p]."""
  A: list
  Dinv: list

  def lower(self, Y, prec: Precision):
    """X = L^{-1} Y by block forward substitution; Y, X: lists of [16,W] row tiles."""
    X = []
    for p, Y_p in enumerate(Y):
      for r in range(p):
        Y_p = Y_p - dot(self.A[p][r], X[r], prec.solve)
      X.append(dot(self.Dinv[p], Y_p, prec.solve))
    return X

  def upper_t(self, Y, prec: Precision):
    """X = L^{-T} Y by block backward substitution."""
    P = len(Y)
    X = [None] * P
    for p in reversed(range(P)):
      Y_p = Y[p]
      for m in range(p + 1, P):
        Y_p = Y_p - dot_tn(self.A[m][p], X[m], prec.solve)
      X[p] = dot_tn(self.Dinv[p], Y_p, prec.solve)
    return X


def _setup(q, k, g, b: Rows, dm: Docs, prec: Precision):
  """Score blocks, b per tile, and the solver for (I + A_kk) with A_kk = b * mask * S_kk."""
  P = k.P
  Sqk, Skk = scores(q, k, g, prec)
  bs = [_f32(b.get(p))[:, None] for p in range(P)]
  A = [[jnp.where(block_mask(dm, p, r, strict=True), bs[p] * Skk[p][r], 0.0) for r in range(p + 1)]
       for p in range(P)]
  return Sqk, Skk, bs, Solver(A, [_inverse16(A[p][p], prec) for p in range(P)])


class Prep(NamedTuple):
  """Per chunk, what the state pass needs (scale folded into qg and Aqk): sinks or sources.

  W, qg, kd by (row tile, K block), U by (row tile, V block), Aqk by score block (p, r) for all
  p, r < P (zero above the diagonal), sdec [BK] by K block.
  """
  W: Any
  U: Any
  qg: Any
  kd: Any
  Aqk: Any
  sdec: Any


def prep(q: Tiles, k: Tiles, v: Tiles, g: Tiles, b: Rows, doc: Rows, scale: float, prec: Precision,
         put: Prep):
  """One chunk's W, U, qg, kd, A_qk, sdec (DESIGN §2), float32, handed to the sinks in `put`."""
  P = k.P
  dm = docs(doc, P)
  Sqk, _, bs, solver = _setup(q, k, g, b, dm, prec)
  for p in range(P):
    for r in range(P):
      put.Aqk(p, r, jnp.where(block_mask(dm, p, r, strict=False), scale * Sqk[p][r], 0.0) if r <= p
              else jnp.zeros((TILE, TILE), jnp.float32))

  def w_block(i, carry):
    G, _, GC = gates(g, i)
    eG = [jnp.exp(G_p) for G_p in G]
    ks = [_f32(k.get(p, i)) for p in range(P)]
    W = solver.lower([bs[p] * ks[p] * eG[p] for p in range(P)], prec)
    for p in range(P):
      put.W(p, i, jnp.where(dm.carried[p], W[p], 0.0))
      put.qg(p, i, jnp.where(dm.carried[p], scale * _f32(q.get(p, i)) * eG[p], 0.0))
      put.kd(p, i, jnp.where(dm.last[p], ks[p] * jnp.exp(GC[None, :] - G[p]), 0.0))
    put.sdec(i, jnp.where(dm.whole, jnp.exp(GC), 0.0))
    return carry

  def u_block(i, carry):
    U = solver.lower([bs[p] * _f32(v.get(p, i)) for p in range(P)], prec)
    for p in range(P):
      put.U(p, i, U[p])
    return carry

  _loop(k.n, w_block, 0)
  _loop(v.n, u_block, 0)


class Cols(NamedTuple):
  n: int
  get: Callable[[int], Any]             # i -> block i


def state_grads(S: Cols, dSn: Cols, dO_CV, dVp_CV, Vp_CV, prec: Precision, put: Prep):
  """Cotangents of one chunk's Prep (except dU = dV') from the state pass, on whole-chunk rows.

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
    put.sdec(i, jnp.sum(_f32(S_BV) * _f32(dSn_BV), axis=1))
    return carry

  _loop(S.n, block, 0)


class Grads(NamedTuple):
  """Sinks for the input cotangents: dq, dk, dg by (row tile, K block), dv by V block, db by row tile."""
  q: Callable
  k: Callable
  v: Callable
  g: Callable
  b: Callable


def _route_to_gates(dm: Docs, dG: list, dGC, prec_exact: str):
  """dg_i = sum of dG_j over later rows j of i's own document (+ dG_C for the last document).

  G of a document that starts inside the chunk sums only that document's gates after its first row, so
  nothing crosses a document boundary and the gate at a document start gets no gradient (it decays a
  state that was reset). Tiles from the last; `after` holds what rows beyond the tile owe to the
  document of the tile's last row.
  """
  P = len(dG)
  rows, cols = _iota((TILE, TILE), 0), _iota((TILE, TILE), 1)
  dg = [None] * P
  after = dGC
  for p in reversed(range(P)):
    doc = dm.doc[p]
    same_later = ((cols >= rows) & (doc[:, None] == doc[None, :])).astype(jnp.float32)
    dg_p = dot(same_later, dG[p], prec_exact) + jnp.where((doc == jnp.max(doc))[:, None], after[None, :], 0.0)
    dg[p] = jnp.where(dm.reset[p], 0.0, dg_p)
    if p:
      prev_last = jnp.max(dm.doc[p - 1])
      after = (_colsum(jnp.where((doc == prev_last)[:, None], dG[p], 0.0))
               + jnp.where(prev_last == jnp.max(doc), after, 0.0))
  return dg


def prep_vjp(q: Tiles, k: Tiles, v: Tiles, g: Tiles, b: Rows, doc: Rows, scale: float, prec: Precision,
             d: Prep, put: Grads):
  """Cotangents of (q, k, v, g, b) from those of prep's outputs (d: sources shaped like prep's sinks).

  Hand-derived so that it stays dots and element-wise math:
    dR = L^{-T} dWU,  dA_kk = -mask(dR WU^T),  and for S[i,j] = sum_d x_id y_jd e^{G_id - G_jd}
    dG = x * dx - y * dy, which avoids differentiating the decay factors one by one.
  """
  P = k.P
  dm = docs(doc, P)
  _, Skk, bs, solver = _setup(None, k, g, b, dm, prec)
  dWc = lambda p, i: jnp.where(dm.carried[p], _f32(d.W.get(p, i)), 0.0)

  # Through W = L^{-1} (b k e^G) (carried rows) and U = L^{-1} (b v): dA_kk and the direct parts of db.
  def accumulate(carry, X, dR, Y):
    acc, db = [list(x) for x in carry[0]], list(carry[1])
    for p in range(P):
      for r in range(p + 1):
        acc[p][r] = acc[p][r] + dot_nt(dR[p], X[r], prec.solve)
      db[p] = db[p] + jnp.sum(dR[p] * Y[p], axis=1)
    return tuple(map(tuple, acc)), tuple(db)

  def k_block(i, carry):
    G, _, _ = gates(g, i)
    kg = [_f32(k.get(p, i)) * jnp.exp(G[p]) for p in range(P)]
    return accumulate(carry, solver.lower([bs[p] * kg[p] for p in range(P)], prec),
                      solver.upper_t([dWc(p, i) for p in range(P)], prec), kg)

  def v_block(i, carry):
    vs = [_f32(v.get(p, i)) for p in range(P)]
    dR = solver.upper_t([_f32(d.U.get(p, i)) for p in range(P)], prec)
    for p in range(P):
      put.v(p, i, bs[p] * dR[p])
    return accumulate(carry, solver.lower([bs[p] * vs[p] for p in range(P)], prec), dR, vs)

  carry = (tuple(tuple([jnp.zeros((TILE, TILE), jnp.float32)] * (p + 1)) for p in range(P)),
           tuple([jnp.zeros((TILE,), jnp.float32)] * P))
  acc, db = _loop(v.n, v_block, _loop(k.n, k_block, carry))
  dPkk, dPqk = [], []
  for p in range(P):
    dA = [-jnp.where(block_mask(dm, p, r, strict=True), acc[p][r], 0.0) for r in range(p + 1)]
    put.b(p, db[p] + sum(jnp.sum(dA[r] * Skk[p][r], axis=1) for r in range(p + 1)))
    dPkk.append([bs[p] * dA[r] for r in range(p + 1)])
    dPqk.append([jnp.where(block_mask(dm, p, r, strict=False), scale * _f32(d.Aqk.get(p, r)), 0.0)
                 for r in range(p + 1)])

  def g_block(i, carry):
    G, Ga, GC = gates(g, i)
    qs = [_f32(q.get(p, i)) for p in range(P)]
    ks = [_f32(k.get(p, i)) for p in range(P)]
    eG = [jnp.exp(G_p) for G_p in G]
    dR = solver.upper_t([dWc(p, i) for p in range(P)], prec)
    # kd = k e^{G_C - G} (last document), sdec = e^{G_C} (whole chunk): their G_C part reaches every g.
    dkd = [jnp.where(dm.last[p], _f32(d.kd.get(p, i)) * jnp.exp(GC[None, :] - G[p]), 0.0) for p in range(P)]
    dGC = (sum(_colsum(dkd[p] * ks[p]) for p in range(P))
           + jnp.where(dm.whole, _f32(d.sdec.get(i)) * jnp.exp(GC), 0.0))
    dG = [None] * P
    # Row tiles from the last: column-side score cotangents of tile p are complete once tiles >= p ran.
    dkc = [jnp.zeros_like(ks[0])] * P
    for p in reversed(range(P)):
      Erow = jnp.exp(G[p] - Ga[p][None, :])
      qE, kE = qs[p] * Erow, ks[p] * Erow
      dqE = dkE = jnp.zeros_like(qE)
      for r in range(p + 1):
        cf = _decay(Ga[p], G[r])
        kc = ks[r] * cf
        dqE = dqE + dot(dPqk[p][r], kc, prec.dscore)
        dkE = dkE + dot(dPkk[p][r], kc, prec.dscore)
        dkc[r] = dkc[r] + (dot_tn(dPqk[p][r], qE, prec.dscore) + dot_tn(dPkk[p][r], kE, prec.dscore)) * cf
      dq = dqE * Erow
      dk_row = dkE * Erow
      dk_sol = bs[p] * dR[p] * eG[p]
      # qg = scale q e^G (carried rows).
      dqg = jnp.where(dm.carried[p], scale * _f32(d.qg.get(p, i)) * eG[p], 0.0)
      dG[p] = (dk_sol * ks[p] + qs[p] * dq + ks[p] * dk_row - ks[p] * dkc[p] + dqg * qs[p]
               - dkd[p] * ks[p])
      put.q(p, i, dq + dqg)
      put.k(p, i, dk_sol + dk_row + dkc[p] + dkd[p])
    for p, dg in enumerate(_route_to_gates(dm, dG, dGC, "f32")):
      put.g(p, i, dg)
    return carry

  _loop(k.n, g_block, 0)
