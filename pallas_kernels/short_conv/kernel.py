"""Pallas (Triton lowering) kernels of SiLU(causal depthwise convolution within documents), optionally
l2-normalised over the channels of each column block, and its VJP.

Arrays are [B, T, C], unpadded: a program owns a [row block, column block] tile of one batch row, and
reaches rows before its tile (the taps) or after it (the transposed taps) through row indices clamped
into [0, T) whose rows outside are masked off, so no copy of x is padded. Columns past C (when the
column block does not divide C) are masked loads and stores.

    z_t = round(sum_l w[W-1-l] x_{t-l} [doc_{t-l} = doc_t]),   y_t = silu(z_t),
    out_t = y_t         or, normalised,  y'_t / sqrt(|y'_t|^2 + eps) with y' = y rounded to the output's dtype

`round` is the cast to x's dtype that the reference (reference.short_conv, which returns x's dtype)
applies before the SiLU. The backward pass is two kernels, so that nothing is recomputed W times:
    dz_t = dy_t silu'(z_t)  (dy: the cotangent of y, through the normalisation when there is one),
    dw[W-1-l] = sum_t x_{t-l} dz_t [doc_{t-l} = doc_t]   (per program; XLA sums the programs'),
then, from dz in x's dtype,
    dx_t = sum_m w[W-1-m] dz_{t+m} [doc_t = doc_{t+m}].
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kda.lowering import Tuning, launch
from pallas_kernels.short_conv.reference import silu_grad

_F32 = jnp.float32


class _Tile:
  """Where one program works: batch row b, rows [t0, t0 + bt), columns [c0, c0 + bc) of [B, T, C]."""

  def __init__(self, b, t0, bt: int, c0, bc: int, T: int, C: int):
    self.b, self.t0, self.bt, self.T = b, t0, bt, T
    self.cols = pl.ds(c0, bc)
    # Only where the block does not divide C: clamped column indices, whose loads lose their width.
    c = c0 + jax.lax.broadcasted_iota(jnp.int32, (bc,), 0)
    self.col_ok = None if C % bc == 0 else c < C
    self.col_idx = None if C % bc == 0 else jnp.minimum(c, C - 1)
    # Made once per tile: the dz kernel asks for each mask twice, with a store in between.
    self._masks, self._own_doc = {}, None

  def rows(self, shift: int):
    """Row indices t0 + shift + [0, bt) clamped into [0, T), and which of them were inside."""
    r = self.t0 + shift + jax.lax.broadcasted_iota(jnp.int32, (self.bt,), 0)
    return jnp.clip(r, 0, self.T - 1), (r >= 0) & (r < self.T)

  def load(self, ref, rows):
    """ref[b, rows, cols] as float32 [bt, bc] (zeros in the columns past C)."""
    if self.col_ok is None:
      return ref[self.b, rows, self.cols].astype(_F32)
    x = ref[self.b, rows[:, None], self.col_idx[None, :]].astype(_F32)
    return jnp.where(self.col_ok[None, :], x, 0.0)

  def tap_weight(self, w_ref, j: int):
    """w[j, cols] as float32 [1, bc]."""
    if self.col_ok is None:
      return w_ref[j, self.cols].astype(_F32)[None, :]
    return jnp.where(self.col_ok, w_ref[j, self.col_idx].astype(_F32), 0.0)[None, :]

  def store(self, ref, value):
    """ref[b, rows t0 + [0, bt), cols] = value, for the rows before T and the columns before C."""
    _, ok = self.rows(0)
    mask = ok[:, None] if self.col_ok is None else ok[:, None] & self.col_ok[None, :]
    pltriton.store(ref.at[self.b, pl.ds(self.t0, self.bt), self.cols], value.astype(ref.dtype), mask=mask)

  def same_doc(self, doc_ref, shift: int):
    """[bt] bool: row t + shift exists and, with documents, is in row t's document. Made once per
    shift and tile: the document ids are loaded once, not again for every use."""
    if shift not in self._masks:
      r, ok = self.rows(shift)
      if doc_ref is not None and shift != 0:
        if self._own_doc is None:
          self._own_doc = doc_ref[self.b, self.rows(0)[0]]
        ok = ok & (doc_ref[self.b, r] == self._own_doc)
      self._masks[shift] = ok
    return self._masks[shift]


def _tap(tile: _Tile, x_ref, doc_ref, lag: int):
  """The masked tap x_{t-lag} [doc_{t-lag} = doc_t], float32 [bt, bc]. A select, not a product: a NaN
  in one document must not reach the next (NaN * 0). Taps are loaded again where they are needed rather
  than kept: the loads hit the cache, and W tiles held at once spilled registers."""
  return jnp.where(tile.same_doc(doc_ref, -lag)[:, None], tile.load(x_ref, tile.rows(-lag)[0]), 0.0)


def _conv(tile: _Tile, x_ref, w_ref, doc_ref, W: int):
  z = jnp.zeros((tile.bt, tile.cols.size), _F32)
  for lag in range(W):
    z = z + _tap(tile, x_ref, doc_ref, lag) * tile.tap_weight(w_ref, W - 1 - lag)
  return z.astype(x_ref.dtype).astype(_F32)


def _grid(B: int, T: int, C: int, bt: int, bc: int):
  return (pl.cdiv(T, bt), pl.cdiv(C, bc), B)


def _unpack(refs, n_out: int, has_doc: bool):
  """(input refs with None for an absent doc at index 2, output refs)."""
  ins, outs = list(refs[:-n_out]), refs[-n_out:]
  if not has_doc:
    ins.insert(2, None)
  return ins, outs


def _operands(first, w, doc, *rest):
  """The kernel's operands, the document ids left out when there are none."""
  return (first, w, *rest) if doc is None else (first, w, doc, *rest)


def _own_tile(block_t: int, block_c: int, T: int, C: int) -> _Tile:
  """The tile of this program of a grid over (row blocks, column blocks, batch rows)."""
  return _Tile(pl.program_id(2), pl.program_id(0) * block_t, block_t, pl.program_id(1) * block_c, block_c,
               T, C)


def forward(x, w, doc, *, block_t: int, block_c: int, out_dtype, normalize_eps: float | None,
            interpret: bool, tuning: Tuning):
  """silu(conv) [B, T, C] in out_dtype (l2-normalised over each column block when normalize_eps is
  given) from x [B, T, C], w [W, C] and doc [B, T] int32 or None."""
  B, T, C = x.shape
  W = w.shape[0]

  def kernel(*refs):
    (x_ref, w_ref, doc_ref), (y_ref,) = _unpack(refs, 1, doc is not None)
    tile = _own_tile(block_t, block_c, T, C)
    z = _conv(tile, x_ref, w_ref, doc_ref, W)
    y = z * jax.nn.sigmoid(z)
    if normalize_eps is not None:
      y = y.astype(out_dtype).astype(_F32)  # normalised as rounded to the output's dtype, as the reference
      y = y * jax.lax.rsqrt(jnp.sum(y * y, axis=1, keepdims=True) + normalize_eps)
    tile.store(y_ref, y)

  return launch(kernel, grid=_grid(B, T, C, block_t, block_c),
                out_shape=jax.ShapeDtypeStruct((B, T, C), out_dtype), interpret=interpret, tuning=tuning,
                name="short_conv_silu_fwd")(*_operands(x, w, doc))


def backward_dz(x, w, doc, dout, *, block_t: int, block_c: int, row_blocks: int,
                normalize_eps: float | None, interpret: bool, tuning: Tuning):
  """(dz [B, T, C] in x's dtype, dw partial sums [B, programs along T, W, C] float32) for the cotangent
  dout of forward's output (in forward's out_dtype). A program covers `row_blocks` row blocks in turn
  and sums dw's products over them element-wise, so its threads reduce across rows once, at the end."""
  B, T, C = x.shape
  W = w.shape[0]
  span = block_t * row_blocks

  def kernel(*refs):
    (x_ref, w_ref, doc_ref, dout_ref), (dz_ref, dw_ref) = _unpack(refs, 2, doc is not None)
    i, b, c0 = pl.program_id(0), pl.program_id(2), pl.program_id(1) * block_c

    def one_block(s, acc):
      tile = _Tile(b, i * span + s * block_t, block_t, c0, block_c, T, C)
      z = _conv(tile, x_ref, w_ref, doc_ref, W)
      rows, ok = tile.rows(0)
      dy = jnp.where(ok[:, None], tile.load(dout_ref, rows), 0.0)
      if normalize_eps is not None:
        # out = y r with r = (|y|^2 + eps)^(-1/2):  dy = r dout - r^3 y (y . dout).
        y = (z * jax.nn.sigmoid(z)).astype(dout_ref.dtype).astype(_F32)
        r = jax.lax.rsqrt(jnp.sum(y * y, axis=1, keepdims=True) + normalize_eps)
        dy = r * dy - (r * r * r) * y * jnp.sum(y * dy, axis=1, keepdims=True)
      # Zero rows past T: their z came from clamped rows, and a non-finite one must not reach dw.
      dz = jnp.where(ok[:, None], dy * silu_grad(z), 0.0).astype(dz_ref.dtype)
      tile.store(dz_ref, dz)
      dz = dz.astype(_F32)
      return tuple(a + _tap(tile, x_ref, doc_ref, lag) * dz for lag, a in enumerate(acc))

    zeros = jnp.zeros((block_t, block_c), _F32)
    acc = jax.lax.fori_loop(0, row_blocks, one_block, (zeros,) * W)
    tile = _Tile(b, i * span, block_t, c0, block_c, T, C)
    for lag in range(W):
      part = jnp.sum(acc[lag], axis=0)
      if tile.col_ok is None:
        dw_ref[b, i, W - 1 - lag, tile.cols] = part
      else:
        # (An array index: interpret mode's masked store takes no Python int.)
        tap = jnp.asarray(W - 1 - lag, jnp.int32)
        pltriton.store(dw_ref.at[b, i, tap, tile.cols], part, mask=tile.col_ok)

  out_shape = (jax.ShapeDtypeStruct((B, T, C), x.dtype),
               jax.ShapeDtypeStruct((B, pl.cdiv(T, span), W, C), _F32))
  return launch(kernel, grid=_grid(B, T, C, span, block_c), out_shape=out_shape, interpret=interpret,
                tuning=tuning, name="short_conv_silu_dz")(*_operands(x, w, doc, dout))


def backward_dx(dz, w, doc, *, block_t: int, block_c: int, interpret: bool, tuning: Tuning):
  """dx [B, T, C] in dz's dtype: the transposed taps over dz."""
  B, T, C = dz.shape
  W = w.shape[0]

  def kernel(*refs):
    (dz_ref, w_ref, doc_ref), (dx_ref,) = _unpack(refs, 1, doc is not None)
    tile = _own_tile(block_t, block_c, T, C)
    dx = jnp.zeros((block_t, block_c), _F32)
    for m in range(W):  # row t feeds row t + m through tap w[W-1-m]
      fed = jnp.where(tile.same_doc(doc_ref, m)[:, None], tile.load(dz_ref, tile.rows(m)[0]), 0.0)
      dx = dx + fed * tile.tap_weight(w_ref, W - 1 - m)
    tile.store(dx_ref, dx)

  return launch(kernel, grid=_grid(B, T, C, block_t, block_c),
                out_shape=jax.ShapeDtypeStruct((B, T, C), dz.dtype), interpret=interpret, tuning=tuning,
                name="short_conv_silu_dx")(*_operands(dz, w, doc))
