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

Each matrix is described by MuonDimensionNumbers (moejax.training.optimizers.matrix_axes): every axis that is
neither a reduction nor an output axis (scanned layers, experts) indexes independent matrices.
Parameters of one shape and logical axes (the same projection in every layer) are stacked and
iterated as one batch (`orthogonalise_many`): fewer, larger matmuls, the same arithmetic per matrix.

`ns_implementation`: "xla" runs each step's three products as einsums; "pallas" (GPU) and "interpret"
(CPU) run the two symmetric ones, S = X X^T and P = a I + b S + c S^2, as pallas_kernels.newton_schulz
kernels that compute each pair of mirrored tiles once, and P X as an einsum. "auto" (`resolve_ns`) takes
"pallas" on a GPU, unless the mesh splits the matrices themselves (fsdp, tensor), and "xla" elsewhere.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

from moejax.parallel import mesh as meshlib
from pallas_kernels import newton_schulz as ns_kernels

NS_IMPLEMENTATIONS = ("auto", "xla") + ns_kernels.IMPLEMENTATIONS
MATRIX_SPLITTING_AXES = ("fsdp", "tensor")  # mesh axes that split a weight matrix's own axes

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


def _check_implementation(implementation: str) -> None:
  if implementation not in NS_IMPLEMENTATIONS:
    raise ValueError(f"unknown Newton-Schulz implementation {implementation!r}; expected one of "
                     f"{NS_IMPLEMENTATIONS}")


def resolve_ns(implementation: str) -> str:
  """The Newton-Schulz implementation that runs, "auto" resolved at trace time. On a GPU, "auto" is "pallas":
  on an H100 its whole Muon update over experiments/h200.py was faster than the einsums', at a third of their
  error against float32 (BENCHMARKS.md, "Muon Newton-Schulz"). Under a mesh that splits matrices over fsdp or
  tensor the kernels would iterate each such matrix whole on every device (`_matrices_per_device`), where the
  einsums share the products out, so "auto" is "xla" there, as on every other backend."""
  _check_implementation(implementation)
  if implementation != "auto":
    return implementation
  mesh = jax.sharding.get_abstract_mesh()
  split = not mesh.empty and any(mesh.shape.get(name, 1) > 1 for name in MATRIX_SPLITTING_AXES)
  return "pallas" if jax.default_backend() == "gpu" and not split else "xla"


def newton_schulz(x_MN: jax.Array, steps: int = NS_STEPS, eps: float = 1e-8,
                  implementation: str = "xla", poly_blocks: ns_kernels.Blocks = ns_kernels.POLY_BLOCKS
                  ) -> jax.Array:
  """The quintic iteration on the trailing [M, N] matrices of x (any leading batch axes), in x's
  dtype; the result is ~U V^T of each. `implementation`: one of NS_IMPLEMENTATIONS (module docstring).
  `poly_blocks`: the kernel's blocks for P (S = X X^T takes the kernel's default), with the kernels."""
  implementation = resolve_ns(implementation)
  transpose = x_MN.shape[-2] > x_MN.shape[-1]
  if transpose:  # iterate on the short side: X X^T is m x m
    x_MN = jnp.swapaxes(x_MN, -2, -1)
  norm = jnp.sqrt(jnp.sum(jnp.square(x_MN.astype(jnp.float32)), axis=(-2, -1), keepdims=True))
  x_MN = (x_MN.astype(jnp.float32) / (norm + eps)).astype(x_MN.dtype)
  a, b, c = NS_COEFFS
  m = x_MN.shape[-2]
  a_eye_MM = a * jnp.eye(m, dtype=x_MN.dtype) if implementation == "xla" else None
  for _ in range(steps):
    # a X + (b S + c S^2) X as (a I + b S + c S^2) X: the element-wise work is on the m x m matrix
    # instead of the m x n one, and the last product needs none after it.
    if implementation == "xla":
      s_MM = jnp.einsum("...mn,...kn->...mk", x_MN, x_MN)
      p_MM = a_eye_MM + b * s_MM + c * jnp.einsum("...mk,...kj->...mj", s_MM, s_MM)
    else:  # S is symmetric, so S^2 = S S^T: both are Gram products
      s_MM = ns_kernels.gram_poly(x_MN, implementation=implementation)
      p_MM = ns_kernels.gram_poly(s_MM, c, b, a, implementation=implementation, blocks=poly_blocks)
    x_MN = jnp.einsum("...mk,...kn->...mn", p_MM, x_MN)
  return jnp.swapaxes(x_MN, -2, -1) if transpose else x_MN


def _matrices_per_device(fn, x_MN: jax.Array, batch_names: tuple | None) -> jax.Array:
  """fn(x_MN) with Pallas kernels inside. XLA cannot partition a kernel, so under a mesh of several
  devices it runs in shard_map: the batch axes split by their logical names (`batch_names`, e.g. the
  experts over `expert`; None: unsplit), the matrix axes whole. A matrix whose own axes the parameter
  layout splits (fsdp, tensor) is therefore gathered and iterated whole on each of those devices,
  where the einsum form ("xla") would share its products out."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return fn(x_MN)
  names = tuple(batch_names) if batch_names is not None else (None,) * (x_MN.ndim - 2)
  spec = P(*meshlib.logical_spec(names), None, None)
  x_MN = meshlib.constrain(x_MN, spec)
  # check_vma off: a Pallas kernel's output declares no varying axes; each device's matrices are its own.
  return jax.shard_map(fn, in_specs=spec, out_specs=spec, check_vma=False)(x_MN)


def orthogonalise(x: jax.Array, dims: MuonDimensionNumbers, ns_dtype, steps: int = NS_STEPS,
                  implementation: str = "xla", logical_axes: tuple | None = None) -> jax.Array:
  """NewtonSchulz5 of each matrix of x (float32) in ns_dtype, returned float32 in x's layout. The batch
  axes stay separate axes (not merged), so a sharded one (experts) stays sharded as it was.
  `logical_axes` (x's axis names) place the kernels' work under a mesh (`_matrices_per_device`)."""
  implementation = resolve_ns(implementation)
  batch, red, out = _axes(x, dims)
  order = batch + red + out
  size = lambda axes: math.prod(x.shape[a] for a in axes)
  x_MN = jnp.transpose(x, order).reshape(*(x.shape[a] for a in batch), size(red), size(out))
  iterate = lambda x_MN: newton_schulz(x_MN, steps, implementation=implementation)
  x_MN = x_MN.astype(ns_dtype)
  if implementation == "xla":
    o_MN = iterate(x_MN)
  else:
    batch_names = None if logical_axes is None else tuple(logical_axes[a] for a in batch)
    o_MN = _matrices_per_device(iterate, x_MN, batch_names)
  o_MN = o_MN.astype(jnp.float32)
  o = o_MN.reshape(tuple(x.shape[a] for a in order))
  return jnp.transpose(o, tuple(order.index(a) for a in range(x.ndim)))


def _is_axis_names(key) -> bool:
  """Whether a group key is a parameter's logical axis names (a tuple of str or None)."""
  return isinstance(key, tuple) and all(n is None or isinstance(n, str) for n in key)


def like_matrix_groups(xs: list, dims: list, keys: list | None = None) -> dict[tuple, list[int]]:
  """The indices of xs (arrays or ShapeDtypeStructs) that `orthogonalise_many` stacks and iterates
  together, by (shape, dtype, the dimension numbers' axes, key)."""
  groups: dict = {}
  for i, (x, d) in enumerate(zip(xs, dims, strict=True)):
    key = (tuple(x.shape), jnp.dtype(x.dtype).name, _axes(x, d), None if keys is None else keys[i])
    groups.setdefault(key, []).append(i)
  return groups


def orthogonalise_many(xs: list, dims: list, ns_dtype, steps: int = NS_STEPS,
                       keys: list | None = None, implementation: str = "xla") -> list:
  """`orthogonalise` of each array, with the arrays of equal shape, dimension numbers and key (e.g.
  their logical axes, hence their sharding) stacked on a new leading axis and iterated together: one
  Newton-Schulz per group of like matrices (the same projection in every layer) instead of one per
  array, whose small matmuls would otherwise each pay a kernel's fixed cost. Per matrix, the same
  arithmetic. Keys that are logical axis names also place the Pallas kernels' work under a mesh."""
  out = [None] * len(xs)
  for (_, _, (_, red, outs), key), idx in like_matrix_groups(xs, dims, keys).items():
    names = key if _is_axis_names(key) else None
    if len(idx) == 1:
      out[idx[0]] = orthogonalise(xs[idx[0]], dims[idx[0]], ns_dtype, steps, implementation, names)
      continue
    # The new leading axis is one more batch axis.
    shifted = MuonDimensionNumbers(reduction_axis=tuple(a + 1 for a in red),
                                   output_axis=tuple(a + 1 for a in outs))
    o = orthogonalise(jnp.stack([xs[i] for i in idx]), shifted, ns_dtype, steps, implementation,
                      None if names is None else (None, *names))
    for j, i in enumerate(idx):
      out[i] = o[j]
  return out


def matrix_sizes(x, dims: MuonDimensionNumbers) -> tuple[int, int, int]:
  """(how many matrices, fan-in, fan-out) of a Muon parameter (an array or a ShapeDtypeStruct)."""
  batch, red, out = _axes(x, dims)
  return tuple(math.prod(x.shape[a] for a in axes) for axes in (batch, red, out))


def rms_scale(x: jax.Array, dims: MuonDimensionNumbers, consistent_rms: float) -> float:
  _, fan_in, fan_out = matrix_sizes(x, dims)
  return consistent_rms * math.sqrt(max(fan_in, fan_out))


def scale_by_muon(dimension_numbers, *, beta: float, consistent_rms: float, ns_dtype=jnp.bfloat16,
                  ns_steps: int = NS_STEPS, group_keys=None,
                  ns_implementation: str = "xla") -> optax.GradientTransformation:
  """dimension_numbers: a tree over the params of MuonDimensionNumbers, None where a parameter is
  not a matrix. Meant for the Muon side of optax.partition, which masks the other parameters out
  (optax MaskedNode), so every parameter this sees must have dimension numbers.

  group_keys: an optional tree over the params of hashables (their logical axes): parameters of one
  shape and key are orthogonalised together (`orthogonalise_many`). Without it nothing is grouped."""
  ns_dtype = jnp.dtype(ns_dtype)
  _check_implementation(ns_implementation)
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

    leaves, treedef = jax.tree.flatten(mu_hat, is_leaf=is_masked)
    dims = treedef.flatten_up_to(dimension_numbers)
    keys = treedef.flatten_up_to(group_keys) if group_keys is not None else [None] * len(leaves)
    u_leaves = treedef.flatten_up_to(updates)
    live = [i for i, x in enumerate(leaves) if not is_masked(x)]
    for i in live:
      if dims[i] is None:
        raise ValueError(f"Muon got a parameter of shape {leaves[i].shape} without matrix dimension numbers")
    grouped = keys if group_keys is not None else list(range(len(leaves)))  # distinct: no grouping
    ortho = orthogonalise_many([leaves[i] for i in live], [dims[i] for i in live], ns_dtype, ns_steps,
                               keys=[grouped[i] for i in live], implementation=ns_implementation)
    out = list(leaves)
    for i, o in zip(live, ortho, strict=True):
      out[i] = (o * rms_scale(leaves[i], dims[i], consistent_rms)).astype(u_leaves[i].dtype)
    return jax.tree.unflatten(treedef, out), MuonState(count=count, mu=mu)

  return optax.GradientTransformation(init, update)
