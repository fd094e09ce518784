"""Public grouped matmul: input checks, implementation choice, and the custom VJP over the kernels."""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.backend import require_gpu
from pallas_kernels.gmm.kernel import gmm_pallas, tgmm_pallas
from pallas_kernels.gmm.reference import gmm_xla, tgmm_xla
from pallas_kernels.gmm.tiling import Tiling, resolve_tiling

IMPLEMENTATIONS = ("xla", "pallas", "interpret")


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None, tiling=None, implementation=None,
        rhs_grad_acc=None):
  """Grouped (ragged) matmul with the semantics of jax.lax.ragged_dot(lhs, rhs, group_sizes).

  Rows of lhs are sorted by group: group g owns the next group_sizes[g] rows, and those rows are
  multiplied by rhs[g]. Rows past sum(group_sizes) come out as zeros; if the sum exceeds M the groups
  are cut at row M. Group sizes are dynamic (traced) and must be >= 0; any group may be empty.

  Args:
    lhs_MK: [M, K] floating.
    rhs_GKN: [G, K, N], the same dtype as lhs.
    group_sizes_G: [G] integer.
    preferred_element_type: output dtype, a floating dtype; None -> lhs dtype. Accumulation is always
      float32.
    tiling: None (defaults), a `Tile` for all three kernels, or a `Tiling` (fwd, dlhs, drhs).
    implementation: None -> "pallas" on GPU and "xla" elsewhere; "xla" (jax.lax.ragged_dot);
      "pallas" (the Triton kernels, GPU only); "interpret" (the same kernels in Pallas interpret mode).
    rhs_grad_acc: None, or a gradient accumulator [G, K, N] of rhs's dtype, for accumulating rhs's
      gradient over several backward passes. rhs may then be wider than lhs (a float32 parameter with
      bfloat16 activations); it is rounded to lhs's dtype for the products. The cotangent returned
      for rhs is rhs_grad_acc + rhs's true cotangent, summed in float32 before one rounding to rhs's
      dtype: by the Pallas drhs kernel, which writes it over the accumulator's buffer (aliased, so
      XLA needs no new buffer where the accumulator is not read later) and so spends no pass of its
      own over memory; by an add after ragged_dot_general for "xla". The accumulator's own cotangent
      is zero. So the gradient of a loss in which rhs feeds only this call is the accumulator plus
      this pass's.

  Returns:
    [M, N] in preferred_element_type. Differentiable w.r.t. lhs and rhs, not group_sizes. The backward
    pass casts the output cotangent to the operands' dtype before its two grouped matmuls.
  """
  out_dtype = _check(lhs_MK, rhs_GKN if rhs_grad_acc is None else rhs_GKN.astype(lhs_MK.dtype),
                     group_sizes_G, preferred_element_type)
  implementation = resolve_implementation(implementation)
  tiling = resolve_tiling(tiling)
  m, k = lhs_MK.shape
  if rhs_grad_acc is not None:
    _check_accumulator(rhs_GKN, rhs_grad_acc)
    empty = 0 in (m, k, rhs_GKN.shape[2])
    return _gmm_acc_jit(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32), rhs_grad_acc, out_dtype, tiling,
                        "xla" if empty else implementation)
  if implementation == "xla" or 0 in (m, k, rhs_GKN.shape[2]):
    return gmm_xla(lhs_MK, rhs_GKN, group_sizes_G, out_dtype)
  return _gmm_jit(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32), out_dtype, tiling,
                  implementation == "interpret")


def resolve_implementation(implementation):
  if implementation is None:
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown gmm implementation {implementation!r}; expected one of {IMPLEMENTATIONS}"
                     " or None")
  if implementation == "pallas":
    require_gpu("gmm", "'interpret' to run the kernels on the CPU or 'xla' for jax.lax.ragged_dot")
  return implementation


def _check_accumulator(rhs, acc):
  if getattr(acc, "shape", None) != rhs.shape or acc.dtype != rhs.dtype:
    raise ValueError(f"gmm rhs_grad_acc must have rhs's shape and dtype {rhs.dtype}{list(rhs.shape)}, got "
                     f"{getattr(acc, 'dtype', None)}{list(getattr(acc, 'shape', ()))}")
  if not jnp.issubdtype(rhs.dtype, jnp.floating):
    raise ValueError(f"gmm rhs with a gradient accumulator must be floating, got {rhs.dtype}")


def _check(lhs, rhs, group_sizes, preferred_element_type):
  if getattr(lhs, "ndim", None) != 2:
    raise ValueError(f"gmm lhs must be [M, K], got shape {getattr(lhs, 'shape', None)}")
  if getattr(rhs, "ndim", None) != 3:
    raise ValueError(f"gmm rhs must be [G, K, N], got shape {getattr(rhs, 'shape', None)}")
  if getattr(group_sizes, "ndim", None) != 1:
    raise ValueError(f"gmm group_sizes must be [G], got shape {getattr(group_sizes, 'shape', None)}")
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"gmm group_sizes must be integer, got {group_sizes.dtype}")
  if lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"gmm contraction mismatch: lhs {lhs.shape} vs rhs {rhs.shape} (K differs)")
  if rhs.shape[0] != group_sizes.shape[0]:
    raise ValueError(f"gmm group count mismatch: rhs has {rhs.shape[0]} groups, group_sizes has "
                     f"{group_sizes.shape[0]}")
  if rhs.shape[0] == 0:
    raise ValueError("gmm needs at least one group")
  if not jnp.issubdtype(lhs.dtype, jnp.floating) or lhs.dtype != rhs.dtype:
    raise ValueError(f"gmm lhs and rhs must share one floating dtype, got {lhs.dtype} and {rhs.dtype}")
  out_dtype = lhs.dtype if preferred_element_type is None else jnp.dtype(preferred_element_type)
  if not jnp.issubdtype(out_dtype, jnp.floating):
    raise ValueError(f"gmm preferred_element_type must be floating, got {out_dtype}")
  return out_dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, tiling: Tiling, interpret: bool):
  return gmm_pallas(lhs_MK, rhs_GKN, group_sizes_G, tile=tiling.fwd, out_dtype=out_dtype,
                    interpret=interpret)


def _gmm_fwd(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, tiling, interpret):
  out = _gmm(lhs_MK, rhs_GKN, group_sizes_G, out_dtype, tiling, interpret)
  return out, (lhs_MK, rhs_GKN, group_sizes_G)


def _gmm_bwd(out_dtype, tiling, interpret, res, dy_MN):
  lhs_MK, rhs_GKN, group_sizes_G = res
  dy_MN = dy_MN.astype(lhs_MK.dtype)
  # dlhs[r] = dy[r] @ rhs[g(r)]^T: the forward kernel reading rhs transposed, with zeros past the groups.
  dlhs = gmm_pallas(dy_MN, rhs_GKN, group_sizes_G, tile=tiling.dlhs, out_dtype=lhs_MK.dtype,
                    transpose_rhs=True, interpret=interpret)
  drhs = tgmm_pallas(lhs_MK, dy_MN, group_sizes_G, tile=tiling.drhs, out_dtype=rhs_GKN.dtype,
                     interpret=interpret)
  return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)
# A model calls the op once per MoE layer with the same shapes: as one jitted function, it is traced,
# differentiated and lowered (Pallas -> Triton) once and reused, instead of once per layer.
_gmm_jit = jax.jit(_gmm, static_argnums=(3, 4, 5))


# The gradient-accumulating form: rhs is rounded to lhs's dtype inside, and its cotangent is the
# accumulator plus the pass's drhs, summed in the drhs kernel (or after ragged_dot_general for "xla").


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _gmm_acc(lhs_MK, rhs_GKN, group_sizes_G, acc_GKN, out_dtype, tiling: Tiling, implementation: str):
  return _gmm_acc_fwd(lhs_MK, rhs_GKN, group_sizes_G, acc_GKN, out_dtype, tiling, implementation)[0]


def _gmm_acc_fwd(lhs_MK, rhs_GKN, group_sizes_G, acc_GKN, out_dtype, tiling, implementation):
  rhs_GKN = rhs_GKN.astype(lhs_MK.dtype)
  if implementation == "xla":
    out = gmm_xla(lhs_MK, rhs_GKN, group_sizes_G, out_dtype)
  else:
    out = gmm_pallas(lhs_MK, rhs_GKN, group_sizes_G, tile=tiling.fwd, out_dtype=out_dtype,
                     interpret=implementation == "interpret")
  return out, (lhs_MK, rhs_GKN, group_sizes_G, acc_GKN)


def _gmm_acc_bwd(out_dtype, tiling, implementation, res, dy_MN):
  lhs_MK, rhs_GKN, group_sizes_G, acc_GKN = res
  dy_MN = dy_MN.astype(lhs_MK.dtype)
  if implementation == "xla":
    dlhs = gmm_xla(dy_MN, jnp.swapaxes(rhs_GKN, 1, 2), group_sizes_G, lhs_MK.dtype)
    drhs = (acc_GKN.astype(jnp.float32) + tgmm_xla(lhs_MK, dy_MN, group_sizes_G, jnp.float32)
            ).astype(acc_GKN.dtype)
  else:
    interpret = implementation == "interpret"
    dlhs = gmm_pallas(dy_MN, rhs_GKN, group_sizes_G, tile=tiling.dlhs, out_dtype=lhs_MK.dtype,
                      transpose_rhs=True, interpret=interpret)
    drhs = tgmm_pallas(lhs_MK, dy_MN, group_sizes_G, tile=tiling.drhs, out_dtype=acc_GKN.dtype,
                       acc_GKN=acc_GKN, interpret=interpret)
  return dlhs, drhs, None, None


_gmm_acc.defvjp(_gmm_acc_fwd, _gmm_acc_bwd)
_gmm_acc_jit = jax.jit(_gmm_acc, static_argnums=(4, 5, 6))
