"""Gradient accumulation: how a step's passes (train.microbatch_tokens) add up their gradients and
combine their sown statistics into one step's."""

import math

import jax
import jax.numpy as jnp
from flax import traverse_util

from moejax.moe.layer import EXPERT_WEIGHTS
from moejax.training import optimizers as optim_lib

# How each sown statistic of a pass combines over a step's passes (train_step's `accumulated`), given
# the passes' shares of the batch's documents: the aux loss is a mean over documents.
_PASS_COMBINE = {"load": lambda x, _: jnp.sum(x, 0), "dropped": lambda x, _: jnp.sum(x, 0),
                 "aux_loss": lambda x, docs_P: jnp.tensordot(docs_P, x, 1), "bias_next": lambda x, _: x[-1],
                 "max_logit": lambda x, _: jnp.max(x, 0)}


def combine_passes(stats_P, documents_P):
  """The sown collections of a step's passes (each leaf stacked over passes, axis 0) as one step's:
  `_PASS_COMBINE` by the statistic's name; documents_P [passes]: each pass's share of the documents."""
  def combine(path, x):
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key in _PASS_COMBINE]
    if not names:
      raise ValueError(f"no rule combines the sown statistic {jax.tree_util.keystr(path)} over a step's "
                       f"passes (train.microbatch_tokens): add one to _PASS_COMBINE")
    return _PASS_COMBINE[names[-1]](x, documents_P)

  return jax.tree_util.tree_map_with_path(combine, stats_P)


class AccumulatorLayout:
  """How `accumulated` sums the passes' gradients: in float32 (or the parameter's wider type), and
  the gradients of the parameters that `optim.flattens` (small and unsplit) as one flat float32
  vector: a few kernels a pass for all of them, not one per parameter.

  The routed experts' float32 weights (moe.EXPERT_WEIGHTS, most of the parameters) that are not in
  the flat vector are accumulated by the model itself: their accumulators go in as the collection
  nn.GRAD_ACC and their gradients come back with the accumulator already added, on GPU by the grouped
  matmul's drhs kernel, over the accumulator's buffer. That saves writing each pass's gradient and
  reading it back for a separate add, and the pass's gradient is not rounded to the compute dtype
  before the sum (a one-pass step's is).
  """

  def __init__(self, params):
    paths_and_leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [p for _, p in paths_and_leaves]
    self.shapes = [(p.shape, p.dtype) for p in leaves]
    self.small = [optim_lib.flattens(p) for p in leaves]
    self.flat_size = sum(p.size for p, s in zip(leaves, self.small, strict=True) if s)
    keys = [tuple(getattr(k, "key", None) for k in path) for path, _ in paths_and_leaves]
    # Paths into the collection for the leaves the model accumulates, None for the others.
    self.in_model = [key if not s and p.dtype == jnp.float32 and key[-1] in EXPERT_WEIGHTS
                     and None not in key else None
                     for key, p, s in zip(keys, leaves, self.small, strict=True)]

  def collection(self, acc):
    """The nn.GRAD_ACC collection: the model-accumulated leaves' accumulators at their params' paths."""
    return traverse_util.unflatten_dict({key: a for key, a in zip(self._large(self.in_model), acc[0],
                                                                    strict=True) if key is not None})

  def _large(self, per_leaf):
    """The entries of a per-leaf list that belong to the large leaves (those with accumulators)."""
    return [x for x, s in zip(per_leaf, self.small, strict=True) if not s]

  def zeros(self):
    """(one zero accumulator per large gradient, the flat zero vector of the small ones)."""
    large = [jnp.zeros(shape, jnp.promote_types(dtype, jnp.float32))
             for shape, dtype in self._large(self.shapes)]
    return large, jnp.zeros((self.flat_size,), jnp.float32)

  def add(self, acc, grads):
    large, flat = acc
    leaves = self.treedef.flatten_up_to(grads)
    large_g = self._large(leaves)
    small_g = [g.astype(jnp.float32).reshape(-1) for g, s in zip(leaves, self.small, strict=True) if s]
    # A model-accumulated gradient already holds the accumulator.
    large = [g if key is not None else a + g.astype(a.dtype)
             for a, g, key in zip(large, large_g, self._large(self.in_model), strict=True)]
    if small_g:
      flat = flat + jnp.concatenate(small_g)
    return large, flat

  def gradients(self, acc):
    """The summed gradients as the params' tree, each in its parameter's dtype."""
    large, flat = iter(acc[0]), acc[1]
    out, offset = [], 0
    for (shape, dtype), s in zip(self.shapes, self.small, strict=True):
      if s:
        size = math.prod(shape)
        out.append(flat[offset:offset + size].reshape(shape).astype(dtype))
        offset += size
      else:
        out.append(next(large).astype(dtype))
    return jax.tree.unflatten(self.treedef, out)


def _module_paths(tree, depth: int) -> set:
  """The paths of the leaves of a nested dict, each cut `depth` keys short: their modules' paths."""
  paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(getattr(k, "key", k) for k in path[:-depth]) for path, _ in paths}


def check_taken(grad_acc, taken):
  """Raises unless every module handed gradient accumulators sowed that it took them (trace time)."""
  # An accumulator sits at module/param; a marker at module/name/(the sow's tuple index).
  if missing := _module_paths(grad_acc, 1) - _module_paths(taken, 2):
    raise ValueError(f"the model did not take the gradient accumulators of {sorted(missing)}: their "
                     f"earlier passes' gradients would be lost")
