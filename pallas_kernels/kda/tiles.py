"""Per-chunk KDA math shared by the forward and backward Pallas kernels (docs/design.md §2 "Chunked
form"), and `Program`, one kernel program's views of its chunk; the forward's own math is in forward.py,
the backward's in backward.py.

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

import copy
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.lowering import barrier, dot

TILE = 16


class Precision(NamedTuple):
  """Dot precision per role, see lowering.dot: "bf16", "tf32" or "f32"."""
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
  # s = 1 from X = I is I - A_1: no dots (two of the chain's dependent dots fewer, which made the forward
  # prep kernel faster on an H100).
  X = (rows == cols).astype(jnp.float32) - jnp.where(lower_left(1), A, 0.0)
  s = 2
  while s < n:
    X = X - dot(dot(X, jnp.where(lower_left(s), A, 0.0), prec.solve), X, prec.solve)
    s *= 2
  return X


class Program:
  """Views of one prep or state-gradient kernel program's chunk c, head h, batch row b (grid (N, H, B)):
  its operands as Chunk / Rows, sinks for its results and its Scratch."""

  def __init__(self, C, block, interpret):
    self.c, self.h, self.b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    self.C, self.block, self.interpret = C, block, interpret

  def at_chunk(self, c) -> "Program":
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
    return Chunk(ref.shape[-1] // self.block,
                 lambda i: ref[self.b, self.rows(), self.h, self.cols(i)],
                 lambda p, i: ref[self.b, self.rows(p), self.h, self.cols(i)])

  def bhtx(self, ref):
    """A [B,H,T,X] operand."""
    return Chunk(ref.shape[-1] // self.block,
                 lambda i: ref[self.b, self.h, self.rows(), self.cols(i)],
                 lambda p, i: ref[self.b, self.h, self.rows(p), self.cols(i)])

  def bt_rows(self, ref, with_head=True):
    if with_head:
      return Rows(lambda: ref[self.b, self.rows(), self.h], lambda p: ref[self.b, self.rows(p), self.h])
    return Rows(lambda: ref[self.b, self.rows()], lambda p: ref[self.b, self.rows(p)])

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

    return Scratch(
        put_full=put_full,
        full=lambda name: refs[name][b, h, self.rows(), :],
        rows=lambda name, p: refs[name][b, h, self.rows(p), :],
        cols=lambda name, t: refs[name][b, h, self.rows(), pl.ds(t * TILE, TILE)],
        barrier=lambda: barrier(self.interpret))

  def inputs(self, q_ref, k_ref, v_ref, g_ref, beta_ref, code_ref):
    g = self.btx(g_ref)
    return (self.btx(q_ref), self.btx(k_ref), self.btx(v_ref), gate_cumsum(g),
            self.bt_rows(beta_ref), self.bt_rows(code_ref, with_head=False))


def scratch_shapes(B, H, T, C, n):
  """n float32 [B,H,T,C] outputs that serve as the programs' global-memory scratch."""
  return tuple(jax.ShapeDtypeStruct((B, H, T, C), jnp.float32) for _ in range(n))
