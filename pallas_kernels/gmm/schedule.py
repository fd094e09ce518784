"""Traced work lists for the grouped-matmul kernels, computed from the dynamic group sizes.

Triton-lowered Pallas has no scalar prefetch, so the kernels read these small int32 arrays themselves.
"""

from typing import NamedTuple

import jax.numpy as jnp


class Visits(NamedTuple):
  """The forward/dlhs work list: visit v computes rows [lo[v], hi[v]) of row tile tile[v] with group
  group[v]. group == G marks the rows past sum(group_sizes), which are written as zeros. Unused visits
  (the list has a static length) have lo == hi, so they write nothing."""
  group_V: jnp.ndarray
  tile_V: jnp.ndarray
  lo_V: jnp.ndarray
  hi_V: jnp.ndarray


def group_bounds(group_sizes_G, m: int):
  """[start, end) rows of each group. Groups past row m are cut at m, as jax.lax.ragged_dot does."""
  end_G = jnp.clip(jnp.cumsum(group_sizes_G.astype(jnp.int32)), 0, m)
  start_G = jnp.concatenate([jnp.zeros((1,), jnp.int32), end_G[:-1]])
  return start_G, end_G


def num_visits(m: int, num_groups: int, bm: int) -> int:
  """Static bound on the visit count. The G groups and the zero tail cut [0, m) into G + 1 segments;
  each of the G inner cuts adds at most one visit to the cdiv(m, bm) row tiles."""
  return -(-m // bm) + num_groups


def row_tile_visits(group_sizes_G, m: int, bm: int) -> Visits:
  """One visit per (row tile, segment) pair that share rows, in row-tile order."""
  g = group_sizes_G.shape[0]
  start_G, end_G = group_bounds(group_sizes_G, m)
  # Segment G is the tail past the last group: its rows must come out as zeros.
  seg_start_S = jnp.concatenate([start_G, end_G[-1:]])
  seg_end_S = jnp.concatenate([end_G, jnp.full((1,), m, jnp.int32)])
  first_S = seg_start_S // bm
  count_S = jnp.where(seg_end_S > seg_start_S, (seg_end_S - 1) // bm - first_S + 1, 0)
  visits_end_S = jnp.cumsum(count_S)
  v_V = jnp.arange(num_visits(m, g, bm), dtype=jnp.int32)
  # compare_all is one fused kernel; the default binary search is a loop of tiny launches on GPU.
  seg_V = jnp.minimum(jnp.searchsorted(visits_end_S, v_V, side="right", method="compare_all"),
                      g).astype(jnp.int32)
  tile_V = first_S[seg_V] + v_V - (visits_end_S - count_S)[seg_V]
  used_V = v_V < visits_end_S[-1]
  lo_V = jnp.maximum(seg_start_S[seg_V], tile_V * bm)
  hi_V = jnp.minimum(seg_end_S[seg_V], tile_V * bm + bm)
  zero = jnp.zeros_like(v_V)
  return Visits(group_V=jnp.where(used_V, seg_V, g),
                tile_V=jnp.where(used_V, tile_V, zero),
                lo_V=jnp.where(used_V, lo_V, zero),
                hi_V=jnp.where(used_V, hi_V, zero))


def largest_first(group_sizes_G):
  """Group order for the drhs kernel: one program walks a whole group, so starting the longest groups
  first shortens the tail when sizes are skewed."""
  return jnp.argsort(-group_sizes_G.astype(jnp.int32), stable=True).astype(jnp.int32)
