"""Tile shapes and launch settings of the three grouped-matmul kernels (forward, dlhs, drhs)."""

import dataclasses

from pallas_kernels.triton_masks import next_pow2


@dataclasses.dataclass(frozen=True)
class Tile:
  """One kernel's tile.

  For the forward and dlhs kernels an output tile is [bm rows, bn cols], reduced over the contraction in
  steps of bk. For the drhs kernel an output tile is [bk, bn] of one group, reduced over that group's
  rows in steps of bm. Every size must be a power of two >= 16 (Triton block shapes); a size larger than
  the matching array dimension is shrunk to fit (`fitted`).
  """
  bm: int = 128
  bk: int = 64
  bn: int = 128
  num_warps: int = 4
  num_stages: int = 4

  def __post_init__(self):
    for name in ("bm", "bk", "bn"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
        raise ValueError(f"Tile.{name} must be a power of two >= 16, got {v!r}")
    for name in ("num_warps", "num_stages"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"Tile.{name} must be a positive int, got {v!r}")

  def fitted(self, m: int, k: int, n: int) -> "Tile":
    """This tile with each size cut down to the next power of two >= the dimension (and >= 16)."""
    fit = lambda b, d: min(b, max(16, next_pow2(d)))
    return dataclasses.replace(self, bm=fit(self.bm, m), bk=fit(self.bk, k), bn=fit(self.bn, n))


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Tiles of the forward gmm, of dlhs = gmm(dy, rhs^T) and of drhs = tgmm(lhs, dy).

  The forward and dlhs default is the best of benchmarks/gmm.py's sweep on the H200 at G=64 M=65536
  K=2048 N=1024 (BENCHMARKS.md, "Grouped matmul"). The drhs default was not the best there (32x128x128
  with 4 warps and 4 stages ran 0.532 ms against 0.596 ms); it stays until a full sweep of both shapes.
  """
  fwd: Tile = Tile(bm=128, bk=64, bn=256, num_warps=8, num_stages=3)
  dlhs: Tile = Tile(bm=128, bk=64, bn=256, num_warps=8, num_stages=3)
  drhs: Tile = Tile(bm=64, bk=128, bn=128, num_warps=8, num_stages=3)

  def __post_init__(self):
    for name in ("fwd", "dlhs", "drhs"):
      if not isinstance(getattr(self, name), Tile):
        raise ValueError(f"Tiling.{name} must be a Tile, got {getattr(self, name)!r}")


DEFAULT_TILING = Tiling()


def resolve_tiling(tiling) -> Tiling:
  """None -> the default; a single Tile -> that tile for all three kernels."""
  if tiling is None:
    return DEFAULT_TILING
  if isinstance(tiling, Tile):
    return Tiling(tiling, tiling, tiling)
  if isinstance(tiling, Tiling):
    return tiling
  raise ValueError(f"tiling must be None, a Tile or a Tiling, got {tiling!r}")

