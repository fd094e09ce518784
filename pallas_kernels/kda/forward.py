"""The forward KDA prep kernel, parallel over chunks (one program per chunk, head and batch row), and
its per-chunk math as whole-chunk dots (docs/design.md §2 "Chunked form").

prep_forward: inputs -> W, U, qg, kd, A_qk, sdec for the state pass (scan.py, or mosaic/), and for
training the solve (strict S_kk, Linv) for backward.prep_backward.

Layouts: q, k [B,T,H,K], v [B,T,H,V], beta [B,T,H] as the caller gives them (T padded to a whole number
of chunks), the log-decays g [B,T,H,K] (bf16 or float32; the kernels take its in-chunk cumsum G
themselves), row codes [B,T]; per-chunk results [B,H,T,*] so the sequential pass reads contiguous
tiles; sdec [B,H,N,K].

Every product is a [C,*] x [*,C] or [C,C] x [C,*] dot: faster than the block-wise form this replaced,
each 16x16 block of the scores and the solve its own dot, at chunks 32 and 64 (BENCHMARKS.md, "KDA
kernel"); at chunk 32 with 128 columns and 4 warps both use the 255 registers per thread that ptxas
allows, so an SM holds 8 warps of either.

Scores by 16-row strip p, anchored on the strip's first row a (tiles.py's docstring says why this is
bounded): with R = x e^{G - G_anchor(row)} made once for all rows, each row's own strip anchor,
  S = sum_p mask_p(R) (k e^{G_a(p) - G})^T,
mask_p keeping strip p's rows and the column factor cut after strip p before its exp. With the other
strips' rows zero, the score dots do P whole [C,C] products where the lower-triangular blocks need
(P + 1) / 2P of one. The zero rows meet every column factor of strip p, so those must be finite: the
gates' bound (g >= -5, e^{G_a - G_j} <= e^75) is what keeps 0 * inf out of the scores, not only what
keeps them accurate.
Solve: Linv = (I + A)^{-1}, A = b * strict(S_kk), by doubling over the whole chunk (tiles.inverse).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.lowering import Tuning, barrier, dot, dot_nt, launch
from pallas_kernels.kda.tiles import (
  TILE,
  Chunk,
  Gates,
  Precision,
  Program,
  Rows,
  docs,
  f32,
  from_anchor,
  full_mask,
  inverse,
  iota,
  loop,
  scratch_shapes,
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
  """One chunk's W, U, qg, kd, A_qk, sdec (docs/design.md §2), float32, handed to the sinks in `put`.
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


def prep_forward(q, k, v, g, beta, code, *, chunk: int, block: int, scale: float, prec: Precision,
                 store_dtype, interpret: bool, tuning: Tuning, keep_solve: bool = False,
                 merge_pairs: bool = False):
  """Returns W, U, qg, kd, Aqk, sdec: [B,H,T,K|V|K|K|C] in store_dtype and [B,H,N,K] float32; with
  keep_solve also the solve that prep_backward needs: strict S_kk and Linv, [B,H,T,C] float32 each.

  merge_pairs (N even, no keep_solve): a program preps chunks 2p and 2p+1 and merges them into one chunk
  of 2C rows (merge_pair); Aqk is then [B,H,T,2C] and sdec [B,H,N/2,K], the operands of a state pass at
  chunk 2C."""
  if merge_pairs:
    return _prep_forward_pairs(q, k, v, g, beta, code, chunk=chunk, block=block, scale=scale, prec=prec,
                               store_dtype=store_dtype, interpret=interpret, tuning=tuning)
  B, T, H, K = q.shape
  V = v.shape[-1]
  C, N = chunk, T // chunk

  def kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, code_ref, W_ref, U_ref, qg_ref, kd_ref, Aqk_ref,
             sdec_ref, *solve_refs):
    pr = Program(C, block, interpret)
    A_put, Linv_put = (pr.put_square(ref) for ref in solve_refs) if keep_solve else (None, None)
    put = Sinks(W=pr.put_full(W_ref), U=pr.put_full(U_ref), qg=pr.put_full(qg_ref),
                kd=pr.put_full(kd_ref), sdec=pr.put_per_chunk(sdec_ref), Aqk=pr.put_square(Aqk_ref),
                A=A_put, Linv=Linv_put)
    prep(*pr.inputs(q_ref, k_ref, v_ref, g_ref, beta_ref, code_ref), scale, prec, put)

  sd = lambda *shape: jax.ShapeDtypeStruct(shape, store_dtype)
  out_shape = (sd(B, H, T, K), sd(B, H, T, V), sd(B, H, T, K), sd(B, H, T, K), sd(B, H, T, C),
               jax.ShapeDtypeStruct((B, H, N, K), jnp.float32))
  if keep_solve:
    out_shape += scratch_shapes(B, H, T, C, 2)
  return launch(kernel, grid=(N, H, B), out_shape=out_shape, interpret=interpret, tuning=tuning,
                name="kda_prep_fwd")(q, k, v, g, beta, code)


def _prep_forward_pairs(q, k, v, g, beta, code, *, chunk: int, block: int, scale: float,
                        prec: Precision, store_dtype, interpret: bool, tuning: Tuning):
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
    program = Program(C, block, interpret)
    pair = program.c
    halves = [program.at_chunk(2 * pair + half) for half in (0, 1)]
    refs = {"W": W_ref, "U": U_ref, "qg": qg_ref, "kd": kd_ref}

    def prep_half(half, carry):
      # A loop rather than two inlined copies of prep, which ptxas (H200, chunk 32, K=V=128) compiled
      # with 276 bytes of spills; as a loop, none.
      pr = program.at_chunk(2 * pair + half)

      def put_Aqk(x):
        Aqk_ref[pr.b, pr.h, pr.rows(), pl.ds(half * C, C)] = x.astype(Aqk_ref.dtype)

      put = Sinks(W=pr.put_full(W_ref), U=pr.put_full(U_ref), qg=pr.put_full(qg_ref),
                  kd=pr.put_full(kd_ref), sdec=pr.put_per_chunk(sdec_ref), Aqk=put_Aqk)
      prep(*pr.inputs(q_ref, k_ref, v_ref, g_ref, beta_ref, code_ref), scale, prec, put)
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

    views = PairViews(load=load, store=store, sdec=sdec, put_sdec=put_sdec, put_Aqk=put_Aqk,
                      barrier=lambda: barrier(interpret))
    merge_pair(views, K // block, V // block, C, prec)

  sd = lambda *shape: jax.ShapeDtypeStruct(shape, store_dtype)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  out_shape = (sd(B, H, T, K), sd(B, H, T, V), sd(B, H, T, K), sd(B, H, T, K), sd(B, H, T, 2 * C),
               f32(B, H, N // 2, K), f32(B, H, N, K))
  return launch(kernel, grid=(N // 2, H, B), out_shape=out_shape, interpret=interpret, tuning=tuning,
                name="kda_prep_fwd_pairs")(q, k, v, g, beta, code)[:6]
