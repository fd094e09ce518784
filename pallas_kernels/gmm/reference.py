"""XLA forms of the grouped matmul and of its drhs half, on jax.lax.ragged_dot(_general)."""

import jax
import jax.numpy as jnp

_TGMM_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def gmm_xla(lhs_MK, rhs_GKN, group_sizes_G, out_dtype):
  """jax.lax.ragged_dot with float32 accumulation, cast to out_dtype. Differentiable by XLA."""
  out = jax.lax.ragged_dot(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32),
                           preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


def tgmm_xla(lhs_MK, dy_MN, group_sizes_G, out_dtype):
  """[G, K, N] with out[g] = lhs[rows of g]^T @ dy[rows of g] (float32 accumulation)."""
  out = jax.lax.ragged_dot_general(lhs_MK, dy_MN, group_sizes_G.astype(jnp.int32), _TGMM_DIMS,
                                   preferred_element_type=jnp.float32)
  return out.astype(out_dtype)
