"""The symmetric products of Muon's Newton-Schulz step, in XLA: the reference the kernels must match.

    gram_poly(x) = scale_xx * x x^T + scale_x * x + shift * I      for each trailing [m, n] matrix of x

`scale_x` needs symmetric matrices (the kernel reads only their lower tiles). With x = X, scales
(1, 0, 0) this is S = X X^T; with x = S (symmetric), scales (c, b, a) it is the quintic's
P = a I + b S + c S^2, since S S^T = S^2 there.
"""

import jax.numpy as jnp


def gram_poly(x, scale_xx: float = 1.0, scale_x: float = 0.0, shift: float = 0.0, *,
              out_dtype=None, precision=None):
  """In float32 from x's values (its products at `precision`), returned in out_dtype (default x's)."""
  out_dtype = x.dtype if out_dtype is None else out_dtype
  xf = x.astype(jnp.float32)
  out = scale_xx * jnp.einsum("...mn,...kn->...mk", xf, xf, precision=precision)
  if scale_x:
    out = out + scale_x * xf
  if shift:
    out = out + shift * jnp.eye(x.shape[-2], dtype=jnp.float32)
  return out.astype(out_dtype)

