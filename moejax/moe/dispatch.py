"""Dropless local dispatch: sort (token, slot) pairs by expert, grouped SiTU-GLU, un-sort, combine.

The grouped matmuls are `pallas_kernels.gmm` (`implementation`: "auto" is the Pallas kernel on GPU
and `jax.lax.ragged_dot` elsewhere). Rows past the sum of the group sizes come out as zeros, which the
expert-parallel paths rely on for padding.
"""

import functools

import jax
import jax.numpy as jnp

from moejax.config import GROUPED_MATMULS
from moejax.layers.ffn import situ_glu
from pallas_kernels.gmm import gmm


def grouped_situ_glu(x_RL, group_sizes_G, w_gate_GLF, w_up_GLF, w_down_GFL, b1: float, b2: float,
                     implementation: str = "auto", grad_accs=None):
  """Row r, in group g, gets W_d[g] situ_glu(W_g[g] x_r, W_u[g] x_r). Returns [R, L] in x's dtype.

  grad_accs: None, or gradient accumulators of (W_g, W_u, W_d), each of its weight's shape and dtype.
  Then each weight's cotangent comes back as its accumulator plus its own, summed by the grouped
  matmul (`gmm`'s rhs_grad_acc; on GPU inside the drhs kernel): each weight must feed only this call.

  Gate and up are two grouped matmuls. One over [W_g | W_u] measured 2% faster alone (BENCHMARKS.md,
  "Grouped matmul"), but in the H200 step slicing its [R, 2F] output in two and concatenating the two
  gradients cost more than that, in each direction. The matmuls accumulate in float32 and write x's dtype:
  with bfloat16 compute their float32 outputs would be the largest buffers of the layer (k rows per
  token, F wide), and SiTU-GLU and the combine upcast anyway.
  """
  if implementation not in GROUPED_MATMULS:
    raise ValueError(f"grouped matmul implementation {implementation!r} not in {GROUPED_MATMULS}")
  dtype = x_RL.dtype
  gs = group_sizes_G.astype(jnp.int32)
  impl = None if implementation == "auto" else implementation
  if grad_accs is None:
    rdot = lambda a, w, _: gmm(a, w.astype(dtype), gs, preferred_element_type=dtype, implementation=impl)
    grad_accs = (None,) * 3
  else:
    rdot = lambda a, w, acc: gmm(a, w, gs, preferred_element_type=dtype, implementation=impl,
                                 rhs_grad_acc=acc)
  acc_gate, acc_up, acc_down = grad_accs
  h_RF = situ_glu(rdot(x_RL, w_gate_GLF, acc_gate), rdot(x_RL, w_up_GLF, acc_up), b1, b2)
  return rdot(h_RF, w_down_GFL, acc_down)


def sort_by_expert(idx_MK, num_experts: int):
  """Order of the flattened (token, slot) pairs grouped by expert, its inverse permutation (where each
  pair went), and the group sizes."""
  flat_R = idx_MK.reshape(-1)
  order_R = jnp.argsort(flat_R, stable=True).astype(jnp.int32)
  sizes_E = jnp.bincount(flat_R, length=num_experts).astype(jnp.int32)
  return order_R, inverse_permutation(order_R), sizes_E


def inverse_permutation(order_R):
  r = order_R.shape[0]
  return jnp.zeros((r,), jnp.int32).at[order_R].set(jnp.arange(r, dtype=jnp.int32))


# Row gathers whose index is a permutation. Autodiff would transpose them into scatter-adds (XLA
# cannot know the indices never collide), which are slow on the GPU (BENCHMARKS.md, "Training step profile");
# through the inverse permutation the backward pass is a gather too.


@jax.custom_vjp
def permute_rows(x_RL, perm_R, inverse_R):
  """x[perm]: row r is x[perm[r]]. perm must be a permutation of the rows and inverse_R its inverse."""
  return x_RL[perm_R]


def _permute_rows_fwd(x_RL, perm_R, inverse_R):
  return x_RL[perm_R], inverse_R


def _permute_rows_bwd(inverse_R, dy_RL):
  return dy_RL[inverse_R], None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_pairs(x_ML, order_R, inverse_R, k: int):
  """Row r is x[order_R[r] // k], the token of flattened (token, slot) pair order_R[r]; order_R must be
  a permutation of range(M * k) and inverse_R its inverse, as `sort_by_expert` gives. The backward pass
  sums each token's k rows."""
  return x_ML[order_R // k]


def _gather_pairs_fwd(x_ML, order_R, inverse_R, k):
  return x_ML[order_R // k], inverse_R


def _gather_pairs_bwd(k, inverse_R, dx_RL):
  dx_MKL = dx_RL[inverse_R].reshape(inverse_R.shape[0] // k, k, -1)
  return jnp.sum(dx_MKL.astype(jnp.float32), axis=1).astype(dx_RL.dtype), None, None


gather_pairs.defvjp(_gather_pairs_fwd, _gather_pairs_bwd)


def combine(y_sorted_RL, order_R, inverse_R, p_MK):
  """Un-sort the expert outputs back to (token, slot) and take the p-weighted sum, in float32."""
  m, k = p_MK.shape
  y_RL = permute_rows(y_sorted_RL, inverse_R, order_R)
  return jnp.einsum("mkl,mk->ml", y_RL.reshape(m, k, -1).astype(jnp.float32), p_MK.astype(jnp.float32))


def dropless_moe(x_ML, idx_MK, p_MK, w_gate_ELF, w_up_ELF, w_down_EFL, b1: float, b2: float,
                 implementation: str = "auto", grad_accs=None):
  """sum_k p_mk E_{idx_mk}(x_m) for every token, with every expert on this device. float32 [M, L].
  grad_accs: as `grouped_situ_glu`'s."""
  k = idx_MK.shape[1]
  with jax.named_scope("sort_gather"):
    order_R, inverse_R, sizes_E = sort_by_expert(idx_MK, w_gate_ELF.shape[0])
    x_RL = gather_pairs(x_ML, order_R, inverse_R, k)
  with jax.named_scope("grouped_glu"):
    y_RL = grouped_situ_glu(x_RL, sizes_E, w_gate_ELF, w_up_ELF, w_down_EFL, b1, b2, implementation,
                            grad_accs)
  with jax.named_scope("combine"):
    return combine(y_RL, order_R, inverse_R, p_MK)
