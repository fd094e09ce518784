"""Small building blocks shared by every layer: logical-axis params, RMSNorm, dense projections.

Parameters carry MaxText-style logical axis names (`embed`, `heads`, `mlp`, ...) through
`nn.with_logical_partitioning`; the mapping from logical names to mesh axes lives in
`moejax/sharding.py`, never in the math.
"""

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Axes = tuple[str | None, ...]

default_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def logical_param(module: nn.Module, name: str, init_fn, shape: Sequence[int], axes: Axes,
                  dtype=jnp.float32):
  """Declares a parameter annotated with logical axis names (one per dimension)."""
  if len(axes) != len(shape):
    raise ValueError(f"param {name!r}: {len(axes)} logical axes {axes} for shape {tuple(shape)}")
  return module.param(name, nn.with_logical_partitioning(init_fn, axes), tuple(shape), dtype)


class Dense(nn.Module):
  """y = x @ W over the last axis of x, W of shape [in, *features] with logical `axes`.

  `fan_in_axes` is not needed: the input is always the single last axis, so the default
  variance-scaling init sees fan_in = in_features.
  """

  features: int | tuple[int, ...]
  axes: Axes
  use_bias: bool = False
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  kernel_init: object = default_kernel_init

  @nn.compact
  def __call__(self, x):
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    w = logical_param(self, "kernel", self.kernel_init, (x.shape[-1], *features), self.axes,
                      self.param_dtype)
    w = w.reshape(x.shape[-1], -1).astype(self.dtype)
    y = jnp.dot(x.astype(self.dtype), w, preferred_element_type=jnp.float32)
    y = y.reshape(*x.shape[:-1], *features)
    if self.use_bias:
      b = logical_param(self, "bias", nn.initializers.zeros, features, self.axes[1:], self.param_dtype)
      y = y + b
    return y.astype(self.dtype)


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
