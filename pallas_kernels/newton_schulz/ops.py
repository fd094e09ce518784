"""`gram_poly` with input checks over any leading batch axes: the kernels of kernel.py, on the GPU
("pallas") or in Pallas interpret mode ("interpret", how CI runs them on the CPU).

There is no XLA implementation here: moejax.training.muon.newton_schulz keeps its own einsum form as "xla",
and reference.gram_poly is the float32 form the kernels are tested against. No gradients (Newton-Schulz runs
inside the optimizer), so there is no custom VJP and jax.grad through the kernel fails.
"""

import math

import jax.numpy as jnp

from pallas_kernels.backend import require_gpu
from pallas_kernels.newton_schulz import kernel
from pallas_kernels.newton_schulz.kernel import GRAM_BLOCKS, Blocks

IMPLEMENTATIONS = ("pallas", "interpret")


def gram_poly(x, scale_xx: float = 1.0, scale_x: float = 0.0, shift: float = 0.0, *,
              implementation: str = "pallas", blocks: Blocks | None = None):
  """scale_xx * x x^T + scale_x * x + shift * I for each trailing [m, n] matrix of x, in x's dtype
  (float32 accumulation). scale_x needs a symmetric x (m == n): only its lower tiles are read, and the
  result is mirrored from its lower tiles."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown gram_poly implementation {implementation!r}; expected one of "
                     f"{IMPLEMENTATIONS}")
  if implementation == "pallas":
    require_gpu("gram_poly")
  if getattr(x, "ndim", 0) < 2 or 0 in x.shape[-2:]:
    raise ValueError(f"gram_poly needs non-empty matrices [..., m, n], got shape {getattr(x, 'shape', None)}")
  if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise ValueError(f"gram_poly takes bfloat16 or float32, got {x.dtype}")
  m, n = x.shape[-2:]
  if scale_x and m != n:
    raise ValueError(f"gram_poly: scale_x adds x itself, which needs square matrices, got [{m}, {n}]")
  batch = x.shape[:-2]
  if 0 in batch:
    return jnp.zeros((*batch, m, m), x.dtype)
  x_BMN = x.reshape(math.prod(batch), m, n)
  out = kernel.gram_poly_pallas(x_BMN, scale_xx, scale_x, shift, blocks=blocks or GRAM_BLOCKS,
                                interpret=implementation == "interpret")
  return out.reshape(*batch, m, m)
