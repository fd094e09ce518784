"""Small building blocks shared by every layer: logical-axis params, RMSNorm, dense projections.

Parameters carry MaxText-style logical axis names (`embed`, `heads`, `mlp`, ...) through
`nn.with_logical_partitioning`; the mapping from logical names to mesh axes lives in
`moejax/parallel/mesh.py`, never in the math.
"""

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Axes = tuple[str | None, ...]

# The leading logical axis of the params of scanned layers (moejax/model.py): a batch of layers.
LAYERS_AXIS = "layers"


def layers_lead(names: Axes) -> int:
  """How many leading axes of a param with these logical names stack scanned layers: 1 or 0."""
  return 1 if names[:1] == (LAYERS_AXIS,) else 0


def kernel_init(num_in_axes: int, ndim: int):
  """Fan-in init for a kernel whose first `num_in_axes` axes are contracted with the input.

  Spelled out because flax's default takes axis -2 as the input axis, which is wrong for
  [in, heads, dim] kernels (fan_in would come out as `heads`).
  """
  return nn.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=tuple(range(num_in_axes)),
      out_axis=tuple(range(num_in_axes, ndim)))


default_kernel_init = kernel_init(1, 2)  # [in, out] matrices


def matmul(spec: str, x, w, dtype):
  """einsum in the compute dtype with float32 accumulation, cast back to the compute dtype."""
  return jnp.einsum(spec, x.astype(dtype), w.astype(dtype),
                    preferred_element_type=jnp.float32).astype(dtype)


def check_input(x_BTD, d_model: int, layer: str):
  """Raises ValueError unless x is a floating [B,T,D] array with D = d_model."""
  if x_BTD.ndim != 3 or x_BTD.shape[-1] != d_model:
    raise ValueError(f"{layer}: expected input [B,T,D] with D={d_model}, got shape {x_BTD.shape}")
  if not jnp.issubdtype(x_BTD.dtype, jnp.floating):
    raise ValueError(f"{layer}: expected a floating input, got dtype {x_BTD.dtype}")


def logical_param(module: nn.Module, name: str, init_fn, shape: Sequence[int], axes: Axes,
                  dtype=jnp.float32):
  """Declares a parameter annotated with logical axis names (one per dimension)."""
  if len(axes) != len(shape):
    raise ValueError(f"param {name!r}: {len(axes)} logical axes {axes} for shape {tuple(shape)}")
  return module.param(name, nn.with_logical_partitioning(init_fn, axes), tuple(shape), dtype)


class Dense(nn.Module):
  """y = x @ W over the last axis of x, W of shape [in, *features] with logical `axes`."""

  features: int | tuple[int, ...]
  axes: Axes
  use_bias: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  kernel_init: object = None  # default: fan-in over the single input axis

  @nn.compact
  def __call__(self, x):
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    init = self.kernel_init or kernel_init(1, 1 + len(features))
    w = logical_param(self, "kernel", init, (x.shape[-1], *features), self.axes, self.param_dtype)
    y = dense_apply(w, x, self.dtype, out_dtype=jnp.float32)
    if self.use_bias:
      b = logical_param(self, "bias", nn.initializers.zeros, features, self.axes[1:], self.param_dtype)
      y = y + b
    return y.astype(self.dtype)


def dense_apply(w, x, dtype, out_dtype=None):
  """x @ w over x's last axis, w [in, *features]: operands in `dtype`, float32 accumulation, the
  result in out_dtype (default dtype). Dense's math, for code that holds the kernel itself."""
  y = jnp.dot(x.astype(dtype), w.reshape(w.shape[0], -1).astype(dtype), preferred_element_type=jnp.float32)
  return y.reshape(*x.shape[:-1], *w.shape[1:]).astype(out_dtype or dtype)


def rms_norm(x, scale=None, eps: float = 1e-6):
  """RMSNorm in float32 over the last axis; returns float32."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y if scale is None else y * scale.astype(jnp.float32)


class RMSNorm(nn.Module):
  """RMSNorm with a learned per-channel scale (initialised to one)."""

  eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  axis_name: str | None = "norm"

  @nn.compact
  def __call__(self, x):
    scale = logical_param(self, "scale", nn.initializers.ones, (x.shape[-1],), (self.axis_name,),
                          self.param_dtype)
    return rms_norm(x, scale, self.eps).astype(self.dtype)
