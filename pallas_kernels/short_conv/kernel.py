"""Pallas (Triton lowering) kernels of SiLU(causal depthwise convolution within documents), and its VJP.

Arrays are [B, rows, C] with C a multiple of the column block and, for x and the document ids, W-1
rows of padding in front and W-1 behind, and the rows a multiple of the row block. The padding rows
hold zeros in x (and in dy), so a tap that reaches one adds nothing whatever its id (-1 in front, -2
behind). One program owns a [row block, column block] tile of one batch row.

    z_t = round(sum_l w[W-1-l] x_{t-l} [doc_{t-l} = doc_t]),   y_t = silu(z_t)

`round` is the cast to x's dtype that the reference (reference.short_conv, which returns x's dtype)
applies before the SiLU. The backward pass recomputes z at the W rows each x row feeds:
    dz_t = dy_t silu'(z_t),   dx_t = sum_m w[W-1-m] dz_{t+m} [doc_t = doc_{t+m}],
    dw[W-1-l] = sum_t x_{t-l} dz_t [doc_{t-l} = doc_t]  (per program, summed over programs by XLA).
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.pallas_backend import Tuning, launch
from pallas_kernels.short_conv.reference import silu_grad

_F32 = jnp.float32


def _tap_sum(x_ref, w_ref, doc_ref, b, start, rows, cols, W, round_dtype):
  """z at padded rows [start, start + rows) (x and doc are front-padded by W-1), float32 [rows, BC],
  and the masked taps x_{t-l} [doc_{t-l} = doc_t] for each lag l."""
  doc_t = doc_ref[b, pl.ds(start, rows)]
  z = jnp.zeros((rows, cols.size), _F32)
  taps = []
  for lag in range(W):
    src = pl.ds(start - lag, rows)
    tap = jnp.where((doc_ref[b, src] == doc_t)[:, None], x_ref[b, src, cols].astype(_F32), 0.0)
    taps.append(tap)
    z = z + tap * w_ref[W - 1 - lag, cols].astype(_F32)[None, :]
  return z.astype(round_dtype).astype(_F32), taps, doc_t


def forward(x, w, doc, *, rows: int, block_t: int, block_c: int, out_dtype, interpret: bool,
            tuning: Tuning):
  """silu(conv) [B, rows, C] in out_dtype, from padded x [B, rows + 2(W-1), C] and doc."""
  B, _, C = x.shape
  W = w.shape[0]

  def kernel(x_ref, w_ref, doc_ref, y_ref):
    i, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_c, block_c)
    z, _, _ = _tap_sum(x_ref, w_ref, doc_ref, b, i * block_t + W - 1, block_t, cols, W, x_ref.dtype)
    y_ref[b, pl.ds(i * block_t, block_t), cols] = (z * jax.nn.sigmoid(z)).astype(y_ref.dtype)

  return launch(kernel, grid=(rows // block_t, C // block_c, B),
                out_shape=jax.ShapeDtypeStruct((B, rows, C), out_dtype), interpret=interpret, tuning=tuning,
                name="short_conv_silu_fwd")(x, w, doc)


def backward(x, w, doc, dy, *, rows: int, block_t: int, block_c: int, interpret: bool, tuning: Tuning):
  """(dx [B, rows, C] in x's dtype, dw partial sums [B, rows / block_t, W, C] float32); dy is
  [B, rows + W-1, C] with zeros behind."""
  B, _, C = x.shape
  W = w.shape[0]

  def kernel(x_ref, w_ref, doc_ref, dy_ref, dx_ref, dw_ref):
    i, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_c, block_c)
    t0 = i * block_t
    doc_self = doc_ref[b, pl.ds(t0 + W - 1, block_t)]
    dx = jnp.zeros((block_t, block_c), _F32)
    for m in range(W):  # z at the rows t + m that row t feeds with tap w[W-1-m]
      z, taps, doc_m = _tap_sum(x_ref, w_ref, doc_ref, b, t0 + m + W - 1, block_t, cols, W, x_ref.dtype)
      dz = dy_ref[b, pl.ds(t0 + m, block_t), cols].astype(_F32) * silu_grad(z)
      tap_w = w_ref[W - 1 - m, cols].astype(_F32)[None, :]
      dx = dx + jnp.where((doc_self == doc_m)[:, None], dz, 0.0) * tap_w
      if m == 0:
        for lag in range(W):
          dw_ref[b, i, W - 1 - lag, cols] = jnp.sum(taps[lag] * dz, axis=0)
    dx_ref[b, pl.ds(t0, block_t), cols] = dx.astype(dx_ref.dtype)

  out_shape = (jax.ShapeDtypeStruct((B, rows, C), x.dtype),
               jax.ShapeDtypeStruct((B, rows // block_t, W, C), _F32))
  return launch(kernel, grid=(rows // block_t, C // block_c, B), out_shape=out_shape, interpret=interpret,
                tuning=tuning, name="short_conv_silu_bwd")(x, w, doc, dy)
