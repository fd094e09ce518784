"""Optimisers: AdamW, or Muon on weight matrices with AdamW on the rest; warmup + cosine; clipping.

Which parameters Muon orthogonalises is read off their logical axis names (moejax/nn.py), never off
their paths. A leading "layers" axis (scanned layers) and an "expert" axis are batches of independent
matrices. A kernel that ends in
"embed" projects back to the residual stream, so every axis before it is contracted (W_o
[heads, kv, embed]); any other kernel contracts its first axis, which must then be an input axis
(embed, mlp, latent, a LoRA rank). What has no input axis is a bias or per-head vector
(dt_bias [heads, kv]). Embeddings, the LM head ("vocab"), norm scales, biases, gate vectors,
convolution taps and the router ([embed, expert]: its trailing expert axis is its output, and it
feeds the balancing) stay on AdamW, as is usual for Muon. Muon's own update is moejax/training/muon.py.
"""

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util
from optax.contrib import MuonDimensionNumbers

from moejax.nn import LAYERS_AXIS, layers_lead
from moejax.parallel.mesh import splits_params
from moejax.training.muon import scale_by_muon

_ADAM_ONLY_AXES = {"vocab", "conv", "norm", "grid"}
_INPUT_AXES = {"embed", "mlp", "latent", "q_lora", "kv_lora", "rank"}

# Gradients of at most this many elements (norm scales, gates, biases, low-rank factors: 259 of
# experiments/h200.py's 448 parameters) are reduced, and summed over a step's passes, as one flat
# concatenation: a few kernels (XLA splits a long concatenation) instead of one per leaf.
SMALL_LEAF = 1 << 18


def flattens(x) -> bool:
  """Whether leaf `x` (an array, or a tracer of the computation being traced) joins the flat
  concatenation of small leaves: float32 (or narrower), at most SMALL_LEAF elements, and split by no
  mesh. Concatenating split leaves would gather them (under an Explicit mesh, refuse to): both the
  leaf's own sharding and the mesh of `jax.set_mesh` (whose Auto axes leave the leaf's type
  unsharded) are checked."""
  x = jnp.asarray(x) if not hasattr(x, "dtype") else x
  if x.size > SMALL_LEAF or jnp.promote_types(x.dtype, jnp.float32) != jnp.float32:
    return False
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()
  return all(axes is None for axes in spec) and not splits_params(jax.sharding.get_abstract_mesh())


def global_norm(tree) -> jax.Array:
  """The 2-norm over every leaf (optax.tree.norm, up to rounding), summed in float32 (or a leaf's
  wider type), with the leaves that `flattens` reduced as one concatenation."""
  small, large = [], []
  for x in map(jnp.asarray, jax.tree.leaves(tree)):
    if flattens(x):
      small.append(x.astype(jnp.float32).reshape(-1))
    else:
      large.append(x.astype(jnp.promote_types(x.dtype, jnp.float32)))
  if len(small) > 1:
    large.append(jnp.concatenate(small))
  else:
    large += small
  return jnp.sqrt(sum((jnp.sum(jnp.square(x)) for x in large), jnp.zeros((), jnp.float32)))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm, up to rounding (it scales by max_norm / norm in float32), with
  `global_norm`, and with its empty state, so checkpoints of either restore into the other: updates
  scaled by max_norm / norm where the norm exceeds max_norm."""

  def update(updates, state, params=None):
    del params
    norm = global_norm(updates)
    scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def learning_rate_schedule(cfg_opt, total_steps: int):
  """The rate of update `count` (0-based): linear warmup to cfg_opt.lr at update warmup_steps - 1,
  starting from lr / warmup_steps (not 0, which would make the first update none), then cosine decay
  to lr * final_lr_fraction at the last update, total_steps - 1. A warmup as long as the run or longer
  ends at the peak on the last update, with no decay."""
  warmup = min(cfg_opt.warmup_steps, total_steps)
  peak, end = cfg_opt.lr, cfg_opt.lr * cfg_opt.final_lr_fraction
  top = max(warmup - 1, 0)  # the first update at the peak
  span = max(total_steps - 1 - top, 1)

  def schedule(count):
    count = jnp.asarray(count, jnp.float32)
    rising = peak * (count + 1) / max(warmup, 1)
    decayed = end + (peak - end) * 0.5 * (1 + jnp.cos(jnp.pi * jnp.clip((count - top) / span, 0.0, 1.0)))
    return jnp.where(count < warmup, rising, decayed)

  return schedule


def matrix_axes(names: tuple) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  """(reduction axes, output axes) of a weight matrix, from its logical names; None if not one."""
  lead = layers_lead(names)
  if _ADAM_ONLY_AXES & set(names) or "expert" in names[lead + 1:]:
    return None
  core = [i for i, n in enumerate(names) if n not in ("expert", LAYERS_AXIS)]
  if len(core) < 2:
    return None
  if names[core[-1]] == "embed":
    return tuple(core[:-1]), (core[-1],)
  if names[core[0]] in _INPUT_AXES:
    return (core[0],), tuple(core[1:])
  return None


def muon_dimension_numbers(logical_axes):
  """Per-parameter MuonDimensionNumbers (or None for AdamW) from a tree of logical-axis tuples."""

  def spec(names):
    axes = matrix_axes(names)
    return None if axes is None else MuonDimensionNumbers(reduction_axis=axes[0], output_axis=axes[1])

  return jax.tree.map(spec, logical_axes, is_leaf=lambda x: isinstance(x, tuple))


def _decays(names: tuple) -> bool:
  return "norm" not in names and (matrix_axes(names) is not None or "vocab" in names or "conv" in names)


def weight_decay_mask(logical_axes):
  """Decay weight matrices, embeddings, the head and conv taps; never norm scales, biases, per-head
  vectors or the router."""
  return jax.tree.map(_decays, logical_axes, is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(cfg_opt, logical_axes, total_steps: int) -> optax.GradientTransformation:
  """cfg_opt: config.optim; logical_axes: tree of tuples matching params (see train_state)."""
  schedule = learning_rate_schedule(cfg_opt, total_steps)
  mask = weight_decay_mask(logical_axes)
  if cfg_opt.name == "adamw":
    core = optax.adamw(schedule, b1=cfg_opt.b1, b2=cfg_opt.b2, eps=cfg_opt.eps,
                       weight_decay=cfg_opt.weight_decay, mask=mask)
  elif cfg_opt.name == "muon":
    adam_schedule = learning_rate_schedule(dict_to_cfg(cfg_opt, lr=cfg_opt.adam_lr), total_steps)
    dims = muon_dimension_numbers(logical_axes)
    labels = jax.tree.map(lambda d: "adam" if d is None else "muon", dims,
                          is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
    core = optax.partition({
        "muon": optax.chain(
            scale_by_muon(dims, beta=cfg_opt.muon_beta, consistent_rms=cfg_opt.muon_consistent_rms,
                          ns_dtype=cfg_opt.muon_ns_dtype, group_keys=logical_axes,
                          ns_implementation=cfg_opt.muon_ns_implementation),
            optax.add_decayed_weights(cfg_opt.weight_decay, mask),
            optax.scale_by_learning_rate(schedule)),
        # Nesterov, as optax.contrib.muon's AdamW side.
        "adam": optax.adamw(adam_schedule, b1=cfg_opt.b1, b2=cfg_opt.b2, eps=cfg_opt.eps,
                            weight_decay=cfg_opt.weight_decay, mask=mask, nesterov=True),
    }, labels)
  else:
    raise ValueError(f"optim.name={cfg_opt.name!r}: expected 'adamw' or 'muon'")
  chain = [clip_by_global_norm(cfg_opt.grad_clip)] if cfg_opt.grad_clip > 0 else []
  return optax.chain(*chain, core)


def dict_to_cfg(cfg_opt, **overrides):
  """A copy of the optimiser config with some fields replaced (configs are locked elsewhere)."""
  c = cfg_opt.copy_and_resolve_references()
  c.unlock()
  for k, v in overrides.items():
    c[k] = v
  return c


def qk_clip(params, max_logits, tau: float, alpha: float = 0.5):
  """Per-head QK-clip for MLA (reported: MuonClip): where a head's max pre-softmax logit exceeds tau,
  shrink that head's query and key up-projections by (tau/max)^alpha and (tau/max)^(1-alpha).

  max_logits: {param path prefix of an MLA layer: [heads]} from the "attn_stats" collection sown by
  GatedMLA. The logits are bilinear in W_uq and W_uk, so the product of the two factors brings the
  head's max logit to exactly tau (NoPE: there is no rotary part to leave out).
  Scanned layers carry a leading layers axis on both: max logits [layers, heads] and weights
  [layers, lora, heads, head_dim].
  """
  flat = traverse_util.flatten_dict(params)
  for prefix, m_H in max_logits.items():
    factor_H = jnp.minimum(1.0, tau / jnp.maximum(m_H, 1e-6))
    for name, power in (("w_uq", alpha), ("w_uk", 1.0 - alpha)):
      key = (*prefix, name)
      w = flat[key]  # [(layers,) lora, heads, head_dim]
      if w.shape[:-3] != factor_H.shape[:-1]:
        raise ValueError(f"max logits {factor_H.shape} do not match {'/'.join(key)} {w.shape}")
      flat[key] = (w * (factor_H ** power)[..., None, :, None]).astype(w.dtype)
  return traverse_util.unflatten_dict(flat)
