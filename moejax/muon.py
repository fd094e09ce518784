"""Muon's update for weight matrices: Nesterov momentum, Newton-Schulz orthogonalisation, RMS scaling.

    m     <- beta m + (1 - beta) g                       (float32, kept in the optimizer state)
    m_hat  = beta m / (1 - beta^(t+1)) + (1 - beta) g / (1 - beta^t)
    O      = NewtonSchulz5(m_hat / ||m_hat||_F)          (in `ns_dtype`, one per matrix)
    update = O * consistent_rms * sqrt(max(fan_in, fan_out))

This is optax.contrib.scale_by_muon followed by its scale_by_shape (Frobenius preconditioning, the
quintic coefficients (3.4445, -4.7750, 2.0315), five steps, consistent-RMS scaling as in Moonlight),
with one difference: the iteration runs in `ns_dtype`. In bfloat16, as the original Muon does, its
matmuls run at the bf16 tensor-core rate instead of TF32's; optax iterates in the momentum's dtype.
tests/test_optim.py checks that with ns_dtype=float32 the update equals optax's.

Each matrix is described by MuonDimensionNumbers (moejax.optim.matrix_axes): every axis that is
neither a reduction nor an output axis (scanned layers, experts) indexes independent matrices.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


class MuonState(NamedTuple):
  count: jax.Array
  mu: Any  # float32 momentum, one per matrix parameter


def _axes(x, dims: MuonDimensionNumbers) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
  """(batch, reduction, output) axes of x, non-negative."""
  as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)
  red = tuple(a % x.ndim for a in as_tuple(dims.reduction_axis))
  out = tuple(a % x.ndim for a in as_tuple(dims.output_axis))
  if set(red) & set(out) or not red or not out:
    raise ValueError(f"reduction axes {red} and output axes {out} must be disjoint and non-empty "
                     f"(shape {x.shape})")
  return tuple(a for a in range(x.ndim) if a not in red + out), red, out


def newton_schulz(x_BMN: jax.Array, steps: int = NS_STEPS, eps: float = 1e-8) -> jax.Array:
  """The quintic iteration on a batch of matrices, in x's dtype; the result is ~U V^T of each."""
  transpose = x_BMN.shape[1] > x_BMN.shape[2]
  if transpose:  # iterate on the short side: X X^T is m x m
    x_BMN = jnp.swapaxes(x_BMN, 1, 2)
  norm_B = jnp.sqrt(jnp.sum(jnp.square(x_BMN.astype(jnp.float32)), axis=(1, 2), keepdims=True))
  x_BMN = (x_BMN.astype(jnp.float32) / (norm_B + eps)).astype(x_BMN.dtype)
  a, b, c = NS_COEFFS
  for _ in range(steps):
    s_BMM = jnp.einsum("bmn,bkn->bmk", x_BMN, x_BMN)
    p_BMM = b * s_BMM + c * jnp.einsum("bmk,bkj->bmj", s_BMM, s_BMM)
    x_BMN = a * x_BMN + jnp.einsum("bmk,bkn->bmn", p_BMM, x_BMN)
  return jnp.swapaxes(x_BMN, 1, 2) if transpose else x_BMN


def orthogonalise(x: jax.Array, dims: MuonDimensionNumbers, ns_dtype, steps: int = NS_STEPS) -> jax.Array:
  """NewtonSchulz5 of each matrix of x (float32) in ns_dtype, returned float32 in x's layout."""
  batch, red, out = _axes(x, dims)
  order = batch + red + out
  size = lambda axes: math.prod(x.shape[a] for a in axes)
  x_BMN = jnp.transpose(x, order).reshape(size(batch), size(red), size(out))
  o_BMN = newton_schulz(x_BMN.astype(ns_dtype), steps).astype(jnp.float32)
  o = o_BMN.reshape(tuple(x.shape[a] for a in order))
  return jnp.transpose(o, tuple(order.index(a) for a in range(x.ndim)))


def rms_scale(x: jax.Array, dims: MuonDimensionNumbers, consistent_rms: float) -> float:
  _, red, out = _axes(x, dims)
  fan_in, fan_out = (math.prod(x.shape[a] for a in axes) for axes in (red, out))
  return consistent_rms * math.sqrt(max(fan_in, fan_out))


def scale_by_muon(dimension_numbers, *, beta: float, consistent_rms: float, ns_dtype=jnp.bfloat16,
                  ns_steps: int = NS_STEPS) -> optax.GradientTransformation:
  """dimension_numbers: a tree over the params of MuonDimensionNumbers, None where a parameter is
  not a matrix. Meant for the Muon side of optax.partition, which masks the other parameters out
  (optax MaskedNode), so every parameter this sees must have dimension numbers."""
  ns_dtype = jnp.dtype(ns_dtype)
  is_masked = lambda x: isinstance(x, optax.MaskedNode)

  def init(params):
    return MuonState(count=jnp.zeros((), jnp.int32),
                     mu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

  def update(updates, state, params=None):
    del params
    g = jax.tree.map(lambda u: u.astype(jnp.float32), updates)
    mu = optax.tree.update_moment(g, state.mu, beta, 1)
    count = optax.safe_increment(state.count)
    mu_hat = jax.tree.map(lambda m, u: beta * m + (1 - beta) * u,
                          optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                          optax.tree.bias_correction(g, beta, count))

    def one(x, dims, u):
      if is_masked(x):
        return x
      if dims is None:
        raise ValueError(f"Muon got a parameter of shape {x.shape} without matrix dimension numbers")
      o = orthogonalise(x, dims, ns_dtype, ns_steps)
      return (o * rms_scale(x, dims, consistent_rms)).astype(u.dtype)

    out = jax.tree.map(one, mu_hat, dimension_numbers, updates, is_leaf=is_masked)
    return out, MuonState(count=count, mu=mu)

  return optax.GradientTransformation(init, update)
