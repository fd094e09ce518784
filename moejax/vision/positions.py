"""Where a patch sits: a learned position table interpolated to each image's grid, and 2D RoPE.

The table is [S, S, W], one entry per cell of an S x S grid. An image of gh x gw patches reads it
bicubically resampled to gh x gw (half-pixel centres, Keys' cubic with a = -0.5, taps outside the table
dropped and the rest renormalised: `jax.image.scale_and_translate` without antialiasing computes the
same), so every image, whatever its size, gets a position signal learned on one table; on an S x S
grid the resampling is the identity. Each patch carries its (row, col, gh, gw), so images of different
sizes packed into one row are resampled in one gather of 4 x 4 taps per patch.

2D RoPE rotates the first half of each query/key head by the patch's row and the second half by its
column: attention scores then depend on relative offsets along both axes.
"""

import jax.numpy as jnp


def _keys_cubic(t):
  t = jnp.abs(t)
  near = ((1.5 * t - 2.5) * t) * t + 1.0
  far = ((-0.5 * t + 2.5) * t - 4.0) * t + 2.0
  return jnp.where(t < 1.0, near, jnp.where(t < 2.0, far, 0.0))


def _taps(index_N, size_N, table_side: int):
  """The 4 table indices [N, 4] and their weights [N, 4] (summing to 1) of positions index on a grid of
  `size` cells resampled from `table_side` cells."""
  source = (index_N.astype(jnp.float32) + 0.5) * (table_side / size_N.astype(jnp.float32)) - 0.5
  first = jnp.floor(source).astype(jnp.int32) - 1
  taps = first[:, None] + jnp.arange(4, dtype=jnp.int32)
  weights = _keys_cubic(source[:, None] - taps.astype(jnp.float32))
  weights = jnp.where((taps >= 0) & (taps < table_side), weights, 0.0)
  return jnp.clip(taps, 0, table_side - 1), weights / jnp.sum(weights, axis=1, keepdims=True)


def interpolated_positions(table_SSW, coords_N4):
  """The position entry [N, W] of each patch: `table_SSW` resampled to the patch's image grid, read at
  the patch's cell. coords_N4: (row, col, grid height, grid width) per patch (moejax.vision.patches)."""
  S = table_SSW.shape[0]
  if table_SSW.shape[1] != S:
    raise ValueError(f"the position table must be square, got {table_SSW.shape}")
  rows, row_w = _taps(coords_N4[:, 0], jnp.maximum(coords_N4[:, 2], 1), S)
  cols, col_w = _taps(coords_N4[:, 1], jnp.maximum(coords_N4[:, 3], 1), S)
  out = jnp.zeros((coords_N4.shape[0], table_SSW.shape[-1]), jnp.float32)
  for a in range(4):  # 16 gathers of [N, W] each: never a [N, 16, W] intermediate
    for b in range(4):
      w = (row_w[:, a] * col_w[:, b])[:, None]
      out = out + w * table_SSW[rows[:, a], cols[:, b]].astype(jnp.float32)
  return out


def rope_2d(x_NHD, rows_N, cols_N, theta: float):
  """Rotates the first half of each head's D features by the row, the second half by the column (pairs
  (i, i + D/4) within each half, frequencies theta^(-4i/D)). D must be a multiple of 4."""
  D = x_NHD.shape[-1]
  if D % 4:
    raise ValueError(f"2D RoPE needs a head width divisible by 4, got {D}")
  quarter = D // 4
  freqs = theta ** (-jnp.arange(quarter, dtype=jnp.float32) / quarter)

  def rotate(x, pos_N):
    angle = pos_N.astype(jnp.float32)[:, None, None] * freqs  # [N, 1, D/4]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :quarter].astype(jnp.float32), x[..., quarter:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

  out = jnp.concatenate([rotate(x_NHD[..., :2 * quarter], rows_N), rotate(x_NHD[..., 2 * quarter:], cols_N)],
                        axis=-1)
  return out.astype(x_NHD.dtype)
