"""Pallas (Triton lowering) kernel of `reference.gram_poly`: a symmetric product computed once per pair.

x x^T is symmetric, so a program computes one [bm, bm] tile (i, j) with i >= j of it, over n in steps
of bk, and stores it at (i, j) and, transposed, at (j, i): about half the multiply-adds and half the
output writes of the general matmul that Newton-Schulz's first two products otherwise are. At Muon's
shapes on an H200 (e.g. 1920 matrices of 512 x 768) those matmuls need about as long for their bytes
as for their FLOPs, so both halvings count. Tiles of one matrix are neighbours in launch order and
share its rows in L2. Partial tiles (m or n not a multiple of the block) are masked.

Float32 operands multiply at the dot's default precision, as XLA's einsums do: TF32 on the GPU.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.lowering import Tuning, launch
from pallas_kernels.triton_masks import load, mask_and, next_pow2, store

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))


SHARED_MEMORY_BYTES = 232_448  # per thread block on sm_90 (H100, H200), as the driver reports it


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Tile sizes (powers of two, Triton's) and launch parameters."""
  rows: int = 128  # bm: the output tile is [bm, bm]
  depth: int = 64  # bk: the contraction step
  tuning: Tuning = Tuning(num_warps=8, num_stages=3)

  def __post_init__(self):
    for name in ("rows", "depth"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 16 or v & (v - 1):
        raise ValueError(f"Blocks.{name} must be a power of two >= 16, got {v!r}")

  def shared_memory_bytes(self, itemsize: int) -> int:
    """What Triton's pipelined dot asks for: num_stages copies of the two [bm, bk] operand tiles (the
    H100's refusal of 128, 128, 8 warps, 4 stages in bf16 named exactly this, 262,144 bytes)."""
    return self.tuning.num_stages * 2 * self.rows * self.depth * itemsize

  def fit(self, m: int, n: int, itemsize: int = 2) -> "Blocks":
    """These blocks, shrunk to the matrices where they are smaller (down to 16), and the depth halved
    until the operand tiles fit an sm_90 block's shared memory (float32 needs half bf16's depth)."""
    fitted = dataclasses.replace(self, rows=min(self.rows, max(16, next_pow2(m))),
                                 depth=min(self.depth, max(16, next_pow2(n))))
    while fitted.depth > 16 and fitted.shared_memory_bytes(itemsize) > SHARED_MEMORY_BYTES:
      fitted = dataclasses.replace(fitted, depth=fitted.depth // 2)
    return fitted


GRAM_BLOCKS = Blocks()
"""S = X X^T's blocks: the fastest of the sweep on the largest group (1920 x 512 x 768, H100; BENCHMARKS.md,
"Muon Newton-Schulz")."""
POLY_BLOCKS = Blocks(depth=128)
"""P = a I + b S + c S^2's blocks: in bf16, depth 128 took 1.238 ms against depth 64's 1.343 on that
group's 512 x 512 S (BENCHMARKS.md, "Muon Newton-Schulz"), where X X^T was faster at depth 64. In
float32 `fit` halves the depth to 64 (3 stages of 128 x 128 float32 tiles would need 384 KiB)."""


def tile_pairs(m: int, bm: int) -> tuple[list[int], list[int]]:
  """(i, j) of the lower-triangular tiles, i >= j, row by row."""
  nt = -(-m // bm)
  pairs = [(i, j) for i in range(nt) for j in range(i + 1)]
  return [i for i, _ in pairs], [j for _, j in pairs]


def _gram_kernel(i_ref, j_ref, x_ref, out_ref, *, bm, bk, m, n, tiles, scale_xx, scale_x, shift,
                 precision, upcast):
  pid = pl.program_id(0)
  b, t = pid // tiles, pid % tiles
  i, j = i_ref[t], j_ref[t]
  rows_i, rows_j = i * bm + jnp.arange(bm), j * bm + jnp.arange(bm)
  # Static checks keep the masks out of the evenly divisible case.
  in_i = (rows_i < m)[:, None] if m % bm else None
  in_j = (rows_j < m)[:, None] if m % bm else None

  def body(kk, acc):
    k_in = ((kk * bk + jnp.arange(bk)) < n)[None, :] if n % bk else None
    a = load(x_ref.at[b, pl.ds(i * bm, bm), pl.ds(kk * bk, bk)], mask_and(in_i, k_in))
    c = load(x_ref.at[b, pl.ds(j * bm, bm), pl.ds(kk * bk, bk)], mask_and(in_j, k_in))
    if upcast:
      a, c = a.astype(_F32), c.astype(_F32)
    return acc + lax.dot_general(a, c, _NT, precision=precision, preferred_element_type=_F32)

  acc = lax.fori_loop(0, pl.cdiv(n, bk), body, jnp.zeros((bm, bm), _F32))
  tile = acc * scale_xx if scale_xx != 1.0 else acc
  cols_in = None if in_j is None else in_j.reshape(1, bm)
  if scale_x:  # square x: its own (i, j) tile
    x_ij = load(x_ref.at[b, pl.ds(i * bm, bm), pl.ds(j * bm, bm)], mask_and(in_i, cols_in))
    tile = tile + scale_x * x_ij.astype(_F32)
  if shift:
    tile = tile + jnp.where(rows_i[:, None] == rows_j[None, :], shift, 0.0)
  tile = tile.astype(out_ref.dtype)
  store(out_ref.at[b, pl.ds(i * bm, bm), pl.ds(j * bm, bm)], tile, mask_and(in_i, cols_in))

  @pl.when(i != j)
  def _mirror():
    store(out_ref.at[b, pl.ds(j * bm, bm), pl.ds(i * bm, bm)], tile.T,
          mask_and(in_j, None if in_i is None else in_i.reshape(1, bm)))


def gram_poly_pallas(x_BMN, scale_xx: float, scale_x: float, shift: float, *, blocks: Blocks,
                     interpret: bool):
  """scale_xx * x x^T + scale_x * x + shift * I per matrix of x [B, m, n], in x's dtype (float32
  accumulation)."""
  B, m, n = x_BMN.shape
  blocks = blocks.fit(m, n, x_BMN.dtype.itemsize)
  bm, bk = blocks.rows, blocks.depth
  i_T, j_T = tile_pairs(m, bm)
  tiles = len(i_T)
  # In interpret mode bf16 operands are multiplied in float32, exactly as the tensor cores do (a product
  # of two bf16 values is exact in float32): XLA's CPU dot of one tile with itself (a one-tile matrix,
  # whose tile pair is a constant) has no bf16 x bf16 -> float32 form.
  upcast = interpret and x_BMN.dtype == jnp.bfloat16
  precision = lax.Precision.HIGHEST if upcast else None
  kernel = functools.partial(_gram_kernel, bm=bm, bk=bk, m=m, n=n, tiles=tiles, scale_xx=float(scale_xx),
                             scale_x=float(scale_x), shift=float(shift), precision=precision, upcast=upcast)
  return launch(kernel, grid=(B * tiles,), out_shape=jax.ShapeDtypeStruct((B, m, m), x_BMN.dtype),
                interpret=interpret, tuning=blocks.tuning, name="gram_poly")(
                    jnp.asarray(i_T, jnp.int32), jnp.asarray(j_T, jnp.int32), x_BMN)
