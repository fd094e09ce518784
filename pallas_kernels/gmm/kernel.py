"""Pallas (Triton lowering) kernels of the grouped matmul. All GPU-backend-specific code lives here.

gmm:  out[r] = lhs[r] @ rhs[g(r)]      (rhs [G, K, N], or [G, N, K] read transposed for dlhs)
      and its fused forms (`Fusion`: several products per tile, and an element-wise epilogue)
tgmm: out[g] = lhs[rows of g]^T @ dy[rows of g]

The grid is 1-D and each program decodes its own work item from the schedule arrays (schedule.py):
Triton-lowered Pallas has neither scalar prefetch nor data-dependent index maps, so blocks are addressed
by hand with pl.ds on whole-array refs, and partial tiles are handled with masked loads and stores.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.gmm.schedule import group_bounds, largest_first, num_visits, row_tile_visits
from pallas_kernels.gmm.tiling import Tile

_F32 = jnp.float32
# (contract lhs dim, contract rhs dim) for lax.dot_general.
_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


def _precision(dtype):
  # Triton reads DEFAULT as tf32 for float32 inputs; float32 callers expect float32 products.
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _mask_and(*masks):
  masks = [mk for mk in masks if mk is not None]
  if not masks:
    return None
  return functools.reduce(jnp.logical_and, masks)


def _load(ref, mask):
  if mask is None:
    return ref[...]
  return pltriton.load(ref, mask=mask, other=0)


@dataclasses.dataclass(frozen=True)
class Fusion:
  """What one gmm launch computes per output tile, for fusing neighbours of the plain matmul into it.

  Accumulator a is the sum over `sums[a]` of lhs[i] @ rhs[j] (every pair (i, j) reads its row tile of
  lhs[i] and rhs[j][g]; each operand is loaded once per step however many pairs use it). The epilogue
  maps (the float32 accumulators, then the [bm, bn] tiles of the `num_extras` extra [M, N] inputs at the
  output tile, in their dtype) to the outputs' tiles; None passes the accumulators through. Rows past
  the groups are zeros in every output, whatever the epilogue. The plain gmm is `Fusion()`.
  """
  sums: tuple = (((0, 0),),)
  num_extras: int = 0
  epilogue: Callable | None = None

  @property
  def num_lhs(self) -> int:
    return 1 + max(i for terms in self.sums for i, _ in terms)

  @property
  def num_rhs(self) -> int:
    return 1 + max(j for terms in self.sums for _, j in terms)


def _gmm_kernel(group_ref, tile_ref, lo_ref, hi_ref, *refs, tile: Tile, m, kc, n, num_groups, transpose_rhs,
                precision, fusion: Fusion):
  bm, bk, bn = tile.bm, tile.bk, tile.bn
  n_lhs, n_rhs = fusion.num_lhs, fusion.num_rhs
  lhs_refs, rhs_refs = refs[:n_lhs], refs[n_lhs:n_lhs + n_rhs]
  extra_refs = refs[n_lhs + n_rhs:n_lhs + n_rhs + fusion.num_extras]
  out_refs = refs[n_lhs + n_rhs + fusion.num_extras:]
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
  out_mask = _mask_and(((rows >= lo) & (rows < hi))[:, None], col_in)
  out_at = lambda ref: ref.at[pl.ds(row0, bm), pl.ds(j * bn, bn)]

  def rhs_tile(ref, kk, k_in):
    if transpose_rhs:
      return _load(ref.at[g, pl.ds(j * bn, bn), pl.ds(kk * bk, bk)],
                   _mask_and(None if col_in is None else (cols < n)[:, None],
                             None if k_in is None else k_in[None, :]))
    return _load(ref.at[g, pl.ds(kk * bk, bk), pl.ds(j * bn, bn)],
                 _mask_and(None if k_in is None else k_in[:, None], col_in))

  @pl.when(g < num_groups)
  def _matmul():
    def body(kk, accs):
      ks = kk * bk + jnp.arange(bk)
      k_in = ks < kc if kc % bk else None
      a = [_load(ref.at[pl.ds(row0, bm), pl.ds(kk * bk, bk)],
                 _mask_and(row_in, None if k_in is None else k_in[None, :])) for ref in lhs_refs]
      b = [rhs_tile(ref, kk, k_in) for ref in rhs_refs]
      dims = _NT if transpose_rhs else _NN
      new = []
      for acc, terms in zip(accs, fusion.sums, strict=True):
        for i, jj in terms:
          acc = acc + lax.dot_general(a[i], b[jj], dims, precision=precision, preferred_element_type=_F32)
        new.append(acc)
      return tuple(new)

    accs = lax.fori_loop(0, pl.cdiv(kc, bk), body, tuple(jnp.zeros((bm, bn), _F32) for _ in fusion.sums))
    if fusion.epilogue is None:
      outs = accs
    else:
      extras = [_load(out_at(ref), _mask_and(row_in, col_in)) for ref in extra_refs]
      outs = fusion.epilogue(*accs, *extras)
    for ref, val in zip(out_refs, outs, strict=True):
      pltriton.store(out_at(ref), val.astype(ref.dtype), mask=out_mask)

  @pl.when(g == num_groups)
  def _zeros():
    for ref in out_refs:
      pltriton.store(out_at(ref), jnp.zeros((bm, bn), ref.dtype), mask=out_mask)


def gmm_pallas(lhs_MK, rhs, group_sizes_G, *, tile: Tile, out_dtype, transpose_rhs=False,
               interpret=False):
  """out [M, N] = per-group lhs @ rhs[g]; rhs is [G, K, N], or [G, N, K] when transpose_rhs.

  Rows past sum(group_sizes) are zeros. Inputs are validated by ops.gmm.
  """
  (out,) = gmm_fused_pallas([lhs_MK], [rhs], [], group_sizes_G, fusion=Fusion(), out_dtypes=[out_dtype],
                            tile=tile, transpose_rhs=transpose_rhs, interpret=interpret,
                            name="gmm_t" if transpose_rhs else "gmm")
  return out


def gmm_fused_pallas(lhs_list, rhs_list, extras, group_sizes_G, *, fusion: Fusion, out_dtypes, tile: Tile,
                     transpose_rhs=False, interpret=False, name="gmm_fused"):
  """The outputs [M, N] of `fusion` over lhs [M, K] operands, rhs [G, K, N] (or [G, N, K] when
  transpose_rhs) operands and extra [M, N] inputs, all rows grouped by group_sizes_G."""
  m, kc = lhs_list[0].shape
  g = rhs_list[0].shape[0]
  n = rhs_list[0].shape[1] if transpose_rhs else rhs_list[0].shape[2]
  if len(lhs_list) != fusion.num_lhs or len(rhs_list) != fusion.num_rhs or len(extras) != fusion.num_extras:
    raise ValueError(f"{name}: got {len(lhs_list)} lhs, {len(rhs_list)} rhs and {len(extras)} extra inputs "
                     f"for a fusion of {fusion.num_lhs}, {fusion.num_rhs} and {fusion.num_extras}")
  tile = tile.fitted(m, kc, n)
  visits = row_tile_visits(group_sizes_G, m, tile.bm)
  kernel = functools.partial(_gmm_kernel, tile=tile, m=m, kc=kc, n=n, num_groups=g,
                             transpose_rhs=transpose_rhs, precision=_precision(lhs_list[0].dtype),
                             fusion=fusion)
  return pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct((m, n), dt) for dt in out_dtypes],
      grid=(num_visits(m, g, tile.bm) * pl.cdiv(n, tile.bn),),
      compiler_params=pltriton.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages),
      interpret=interpret,
      name=name,
  )(*visits, *lhs_list, *rhs_list, *extras)


def _tgmm_kernel(order_ref, start_ref, end_ref, lhs_ref, dy_ref, out_ref, *, tile: Tile, k, n, precision):
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
    a = pltriton.load(lhs_ref.at[pl.ds(r0, bm), pl.ds(kt * bk, bk)], mask=_mask_and(row_in, k_in), other=0)
    d = pltriton.load(dy_ref.at[pl.ds(r0, bm), pl.ds(nt * bn, bn)], mask=_mask_and(row_in, n_in), other=0)
    return acc + lax.dot_general(a, d, _TN, precision=precision, preferred_element_type=_F32)

  # Empty groups run no iteration and store zeros, as the gradient of an unused expert must be.
  acc = lax.fori_loop(0, (end - start + bm - 1) // bm, body, jnp.zeros((bk, bn), _F32))
  out_mask = _mask_and(None if k_in is None else (ks < k)[:, None], n_in)
  out_at = out_ref.at[g, pl.ds(kt * bk, bk), pl.ds(nt * bn, bn)]
  pltriton.store(out_at, acc.astype(out_ref.dtype), mask=out_mask)


def tgmm_pallas(lhs_MK, dy_MN, group_sizes_G, *, tile: Tile, out_dtype, interpret=False):
  """out [G, K, N], out[g] = lhs[rows of g]^T @ dy[rows of g]; zeros for empty groups."""
  m, k = lhs_MK.shape
  n = dy_MN.shape[1]
  g = group_sizes_G.shape[0]
  tile = tile.fitted(m, k, n)
  start_G, end_G = group_bounds(group_sizes_G, m)
  order_G = largest_first(end_G - start_G)
  kernel = functools.partial(_tgmm_kernel, tile=tile, k=k, n=n, precision=_precision(lhs_MK.dtype))
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
      grid=(g * pl.cdiv(k, tile.bk) * pl.cdiv(n, tile.bn),),
      compiler_params=pltriton.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages),
      interpret=interpret,
      name="tgmm",
  )(order_G, start_G, end_G, lhs_MK, dy_MN)
