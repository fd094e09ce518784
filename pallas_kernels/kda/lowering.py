"""The Triton lowering of the KDA kernels (forward.py, backward.py, scan.py): they only call `launch`,
`barrier` and the dot helpers below. The state passes, forward and backward, also have Mosaic GPU ports
(mosaic/), which the op picks where they apply (config.Config.scan_lowering) because they measured
faster; the other kernels were not ported (BENCHMARKS.md, "KDA kernel" and "Pallas backend: Triton vs
Mosaic GPU").

Dot precisions: "bf16" casts both operands to bf16 (float32 accumulation), "tf32" keeps float32
operands at the default precision (TF32 on the GPU), "f32" asks for exact float32 (IEEE on the GPU).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Launch parameters of one kernel."""
  num_warps: int = 4
  num_stages: int = 2


def launch(kernel, *, grid, out_shape, interpret: bool, tuning: Tuning, name: str):
  """pallas_call with whole-array refs: kernels index their operands from program ids."""
  return pl.pallas_call(
      kernel, grid=grid, out_shape=out_shape, interpret=interpret, name=name,
      compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages))


def barrier(interpret: bool):
  """A barrier over the program's threads, so global-memory scratch written by some is read by all.
  Interpret mode runs a program sequentially and needs none."""
  if not interpret:
    pltriton.debug_barrier()


_CAST = {"bf16": jnp.bfloat16, "tf32": jnp.float32, "f32": jnp.float32}
_PRECISION = {"bf16": None, "tf32": None, "f32": jax.lax.Precision.HIGHEST}


def _dot(a, b, contract, precision: str):
  if precision not in _CAST:
    raise ValueError(f"unknown dot precision {precision!r}; expected one of {tuple(_CAST)}")
  a, b = a.astype(_CAST[precision]), b.astype(_CAST[precision])
  return jax.lax.dot_general(a, b, (contract, ((), ())), precision=_PRECISION[precision],
                             preferred_element_type=jnp.float32)


def dot(a, b, precision: str):
  """a @ b in float32, for 2-D a and b."""
  return _dot(a, b, ((1,), (0,)), precision)


def dot_nt(a, b, precision: str):
  """a @ b^T in float32."""
  return _dot(a, b, ((1,), (1,)), precision)


def dot_tn(a, b, precision: str):
  """a^T @ b in float32."""
  return _dot(a, b, ((0,), (0,)), precision)
