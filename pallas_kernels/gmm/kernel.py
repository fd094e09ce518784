"""Pallas (Triton lowering) kernels of the grouped matmul. All GPU-backend-specific code lives here.

gmm:  out[r] = lhs[r] @ rhs[g(r)]      (rhs [G, K, N], or [G, N, K] read transposed for dlhs)
tgmm: out[g] = lhs[rows of g]^T @ dy[rows of g]   (+ acc[g], in place, when accumulating a gradient)

The grid is 1-D and each program decodes its own work item from the schedule arrays (schedule.py):
Triton-lowered Pallas has neither scalar prefetch nor data-dependent index maps, so blocks are addressed
by hand with pl.ds on whole-array refs, and partial tiles are handled with masked loads and stores.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gmm.schedule import group_bounds, largest_first, num_visits, row_tile_visits
from pallas_kernels.gmm.tiling import Tile
from pallas_kernels.triton_masks import load, mask_and

_F32 = jnp.float32
# (contract lhs dim, contract rhs dim) for lax.dot_general.
_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


def _precision(dtype):
  # Triton reads DEFAULT as tf32 for float32 inputs; float32 callers expect float32 products.
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _gmm_kernel(group_ref, tile_ref, lo_ref, hi_ref, lhs_ref, rhs_ref, out_ref, *, tile: Tile, m, kc, n,
                num_groups, transpose_rhs, precision):
  bm, bk, bn = tile.bm, tile.bk, tile.bn
  n_tiles = pl.cdiv(n, bn)
  pid = pl.program_id(0)
  # Column tiles of one visit are neighbours in launch order, so they share the lhs tile in L2.
  v, j = pid // n_tiles, pid % n_tiles
  g, row0, lo, hi = group_ref[v], tile_ref[v] * bm, lo_ref[v], hi_ref[v]
  rows = row0 + jnp.arange(bm)
  cols = j * bn + jnp.arange(bn)
  # Static checks keep the masks out of the common, evenly divisible case.
  row_in = (rows < m)[:, None] if m % bm else None
  col_in = (cols < n)[None, :] if n % bn else None
  out_mask = mask_and(((rows >= lo) & (rows < hi))[:, None], col_in)
  out_at = out_ref.at[pl.ds(row0, bm), pl.ds(j * bn, bn)]

  @pl.when(g < num_groups)
  def _matmul():
    def body(kk, acc):
      ks = kk * bk + jnp.arange(bk)
      k_in = ks < kc if kc % bk else None
      a = load(lhs_ref.at[pl.ds(row0, bm), pl.ds(kk * bk, bk)],
                mask_and(row_in, None if k_in is None else k_in[None, :]))
      if transpose_rhs:
        b = load(rhs_ref.at[g, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)],
                  mask_and(None if col_in is None else (cols < n)[:, None],
                            None if k_in is None else k_in[None, :]))
        dims = _NT
      else:
        b = load(rhs_ref.at[g, pl.ds(kk * bk, bk), pl.ds(j * bn, bn)],
                  mask_and(None if k_in is None else k_in[:, None], col_in))
        dims = _NN
      return acc + lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_F32)

    acc = lax.fori_loop(0, pl.cdiv(kc, bk), body, jnp.zeros((bm, bn), _F32))
    pltriton.store(out_at, acc.astype(out_ref.dtype), mask=out_mask)

  @pl.when(g == num_groups)
  def _zeros():
    pltriton.store(out_at, jnp.zeros((bm, bn), out_ref.dtype), mask=out_mask)


def gmm_pallas(lhs_MK, rhs, group_sizes_G, *, tile: Tile, out_dtype, transpose_rhs=False,
               interpret=False):
  """out [M, N] = per-group lhs @ rhs[g]; rhs is [G, K, N], or [G, N, K] when transpose_rhs.

  Rows past sum(group_sizes) are zeros. Inputs are validated by ops.gmm.
  """
  m, kc = lhs_MK.shape
  g = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tile = tile.fitted(m, kc, n)
  visits = row_tile_visits(group_sizes_G, m, tile.bm)
  kernel = functools.partial(_gmm_kernel, tile=tile, m=m, kc=kc, n=n, num_groups=g,
                             transpose_rhs=transpose_rhs, precision=_precision(lhs_MK.dtype))
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(num_visits(m, g, tile.bm) * pl.cdiv(n, tile.bn),),
      compiler_params=pltriton.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages),
      interpret=interpret,
      name="gmm_t" if transpose_rhs else "gmm",
  )(*visits, lhs_MK, rhs)


def _tgmm_kernel(order_ref, start_ref, end_ref, lhs_ref, dy_ref, *refs, tile: Tile, k, n, precision):
  # refs: (out,) or, accumulating, (acc, out) where out is acc's buffer (aliased).
  acc_ref, out_ref = refs if len(refs) == 2 else (None, refs[0])
  bm, bk, bn = tile.bm, tile.bk, tile.bn
  k_tiles, n_tiles = pl.cdiv(k, bk), pl.cdiv(n, bn)
  pid = pl.program_id(0)
  # Group-major launch order: the tiles of one group run together and share its rows in L2.
  gi, rest = pid // (k_tiles * n_tiles), pid % (k_tiles * n_tiles)
  kt, nt = rest // n_tiles, rest % n_tiles
  g = order_ref[gi]
  start, end = start_ref[g], end_ref[g]
  ks = kt * bk + jnp.arange(bk)
  ns = nt * bn + jnp.arange(bn)
  k_in = (ks < k)[None, :] if k % bk else None
  n_in = (ns < n)[None, :] if n % bn else None

  def body(i, acc):
    r0 = start + i * bm
    row_in = (r0 + jnp.arange(bm) < end)[:, None]
    # Both operands are masked: rows of the neighbouring groups may hold anything, inf included.
    a = pltriton.load(lhs_ref.at[pl.ds(r0, bm), pl.ds(kt * bk, bk)], mask=mask_and(row_in, k_in), other=0)
    d = pltriton.load(dy_ref.at[pl.ds(r0, bm), pl.ds(nt * bn, bn)], mask=mask_and(row_in, n_in), other=0)
    return acc + lax.dot_general(a, d, _TN, precision=precision, preferred_element_type=_F32)

  out_mask = mask_and(None if k_in is None else (ks < k)[:, None], n_in)
  tile_at = pl.ds(kt * bk, bk), pl.ds(nt * bn, bn)
  if acc_ref is None:
    start_value = jnp.zeros((bk, bn), _F32)
  else:
    start_value = load(acc_ref.at[g, *tile_at], out_mask).astype(_F32)
  # Empty groups run no iteration and store zeros (or the accumulator as it was), as the gradient of
  # an unused expert must be.
  acc = lax.fori_loop(0, (end - start + bm - 1) // bm, body, start_value)
  pltriton.store(out_ref.at[g, *tile_at], acc.astype(out_ref.dtype), mask=out_mask)


def tgmm_pallas(lhs_MK, dy_MN, group_sizes_G, *, tile: Tile, out_dtype, acc_GKN=None, interpret=False):
  """out [G, K, N], out[g] = lhs[rows of g]^T @ dy[rows of g]; zeros for empty groups.

  With acc_GKN (out_dtype): out = acc + that, summed in float32 before the one rounding, written over
  acc's buffer (aliased), so accumulating a gradient costs no pass of its own over memory."""
  m, k = lhs_MK.shape
  n = dy_MN.shape[1]
  g = group_sizes_G.shape[0]
  tile = tile.fitted(m, k, n)
  start_G, end_G = group_bounds(group_sizes_G, m)
  order_G = largest_first(end_G - start_G)
  kernel = functools.partial(_tgmm_kernel, tile=tile, k=k, n=n, precision=_precision(lhs_MK.dtype))
  operands = (order_G, start_G, end_G, lhs_MK, dy_MN)
  if acc_GKN is not None:
    if acc_GKN.shape != (g, k, n) or acc_GKN.dtype != jnp.dtype(out_dtype):
      raise ValueError(f"tgmm accumulator must be {out_dtype}[{g}, {k}, {n}], got "
                       f"{acc_GKN.dtype}{list(acc_GKN.shape)}")
    operands += (acc_GKN,)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
      grid=(g * pl.cdiv(k, tile.bk) * pl.cdiv(n, tile.bn),),
      input_output_aliases={} if acc_GKN is None else {len(operands) - 1: 0},
      compiler_params=pltriton.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages),
      interpret=interpret,
      name="tgmm_acc" if acc_GKN is not None else "tgmm",
  )(*operands)
