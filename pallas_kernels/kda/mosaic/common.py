"""What the Mosaic GPU state passes (scan_forward.py, scan_backward.py) share: shared-memory tiles and
their sizes, shape checks, the kernel launch, and the decay factors' layout.

Limits: K a multiple of 64 (the state is the M side of kd^T V', qg^T dO and W^T dV'); C and BV powers of
two >= 16, BV <= 256; shared memory (scan_forward.smem_bytes, scan_backward.smem_bytes_backward) within
the H200's 227 KiB (SMEM_LIMIT), which at K = 128 rules out C = 128 except with one slot; bf16 stores
(keep mode's states and V', the backward's dV' and dS) only. scan_forward.unsupported and
scan_backward.unsupported_backward apply these rules for the op.
Interpret mode (interpret=True) runs the kernels on the CPU but executes wgmma and TMA stores
synchronously, so it checks the data flow and the slot rings' barriers, not the asynchronous waits.
"""

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # wgmma M tile of one warpgroup
SMEM_LIMIT = 227 * 1024  # shared memory one CUDA block may ask for on an H100 / H200


def smem_transforms(dtype, width: int, max_elems: int | None = None):
  """Tiling + swizzle of a shared-memory tile whose last dimension is `width` elements: the widest
  swizzle (<= 128 bytes, and <= max_elems elements when given) whose row of elements divides `width`."""
  size = jnp.dtype(dtype).itemsize
  elems = min(128 // size, width, max_elems or width)
  if elems * size < 32 or width % elems:
    raise ValueError(f"no wgmma swizzle fits a last dimension of {width} {jnp.dtype(dtype).name}")
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(elems * size))


def check_shapes(K: int, C: int, block_v: int, V: int):
  """Raises ValueError for shapes this port does not take (see the module docstring)."""
  pow2 = lambda n: n >= 16 and not n & (n - 1)
  if K % ROWS:
    raise ValueError(f"key width {K} must be a multiple of {ROWS} (wgmma rows)")
  if not pow2(C):
    raise ValueError(f"chunk {C} must be a power of two >= 16")
  if not pow2(block_v) or block_v > 256:
    raise ValueError(f"V block {block_v} must be a power of two in [16, 256]")
  if V % block_v:
    raise ValueError(f"V block {block_v} must divide the value width {V}")


def check_scan(K: int, C: int, block_v: int, V: int, T: int, stages: int, bf16_stores: tuple = ()):
  """Raises ValueError for what a Mosaic scan cannot take: shapes (check_shapes), a length that is not
  a whole number of chunks, no slots, or stores asked for in another dtype than bf16
  (bf16_stores: (name, dtype) pairs; the kernels store their bf16 operand tiles)."""
  for name, dtype in bf16_stores:
    if jnp.dtype(dtype) != jnp.bfloat16:
      raise ValueError(f"{name} must be bfloat16 (the kernel stores its bf16 operand tiles), got "
                       f"{jnp.dtype(dtype).name}")
  check_shapes(K, C, block_v, V)
  if T % C:
    raise ValueError(f"length {T} must be a whole number of chunks of {C}")
  if stages < 1:
    raise ValueError(f"stages must be >= 1, got {stages}")


def launch(body, out_type, scratch, *, grid, interpret, name: str):
  """The scans' plgpu.kernel: one warpgroup per program over grid = (V blocks, heads, batch rows), named
  v, h, b; interpret True (or plgpu.InterpretGPUParams) runs it in Mosaic GPU interpret mode."""
  if interpret is True:
    interpret = plgpu.InterpretGPUParams()
  return plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=("v", "h", "b"),
                      interpret=interpret or None, kernel_name=name)


def load_decay(sdec_ref):
  """A slot's decay factors [K] from shared memory, laid out to scale the rows of a wgmma accumulator."""
  return plgpu.load(sdec_ref, layout=plgpu.Layout.WGMMA.reduce(1))


def scale_rows(x_KV, decay_K):
  """diag(decay) x for an accumulator-layout [K, BV] x."""
  return x_KV * lax.broadcast_in_dim(decay_K, x_KV.shape, [0])


def tile_rows(C: int):
  """Rows of the stacked tiles at chunk C: R of [W; qg] (W in rows [0, C), qg in [C, 2C)), `lo`, the
  first row of [W; qg] that the output tile covers, and X of the U and V' tiles (rows [0, C) used)."""
  R = -(-2 * C // ROWS) * ROWS
  return R, C // ROWS * ROWS, -(-C // ROWS) * ROWS


def smem_buffer(dtype, *shape) -> int:
  """Bytes of one shared-memory scratch buffer as Mosaic GPU counts them: rounded up to the 1 KiB it
  aligns scratch to."""
  return -(-math.prod(shape) * jnp.dtype(dtype).itemsize // 1024) * 1024


def shape_or_memory(K: int, C: int, block_v: int, V: int, stages: int, need) -> str | None:
  """Why a Mosaic scan cannot take these shapes, or `need()` bytes of shared memory; None when it can."""
  try:
    check_shapes(K, C, block_v, V)
  except ValueError as e:
    return str(e)
  if (n := need()) > SMEM_LIMIT:
    return f"it needs {n} bytes of shared memory at {stages} slots; one block may use {SMEM_LIMIT}"
  return None
