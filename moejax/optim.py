"""Optimisers: AdamW, or Muon on weight matrices with AdamW on the rest; warmup + cosine; clipping.

Which parameters Muon orthogonalises is read off their logical axis names (moejax/nn.py), never off
their paths: a leading "expert" axis is a batch of independent matrices, the first other axis is the
reduction (input) axis and the remaining axes are the output. Embeddings, the LM head ("vocab" axis),
norm scales, biases, gate vectors and convolution taps stay on AdamW, as is usual for Muon.
"""

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util
from optax.contrib import MuonDimensionNumbers

_ADAM_ONLY_AXES = {"vocab", "conv", "norm"}


def learning_rate_schedule(cfg_opt, total_steps: int):
  warmup = min(cfg_opt.warmup_steps, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg_opt.lr, warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1), end_value=cfg_opt.lr * cfg_opt.final_lr_fraction)


def _is_matrix(names: tuple) -> bool:
  core = [n for n in names if n != "expert"]
  return len(core) >= 2 and not (_ADAM_ONLY_AXES & set(names))


def muon_dimension_numbers(logical_axes):
  """Per-parameter MuonDimensionNumbers (or None for AdamW) from a tree of logical-axis tuples."""

  def spec(names):
    if not _is_matrix(names):
      return None
    axes = [i for i, n in enumerate(names) if n != "expert"]
    return MuonDimensionNumbers(reduction_axis=axes[0], output_axis=tuple(axes[1:]))

  return jax.tree.map(spec, logical_axes, is_leaf=lambda x: isinstance(x, tuple))


def weight_decay_mask(logical_axes):
  """Decay matrices and embeddings; never norm scales, biases or other vectors."""
  return jax.tree.map(lambda names: len([n for n in names if n != "expert"]) >= 2 and "norm" not in names,
                      logical_axes, is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(cfg_opt, logical_axes, total_steps: int) -> optax.GradientTransformation:
  """cfg_opt: config.optim; logical_axes: tree of tuples matching params (see train_state)."""
  schedule = learning_rate_schedule(cfg_opt, total_steps)
  mask = weight_decay_mask(logical_axes)
  if cfg_opt.name == "adamw":
    core = optax.adamw(schedule, b1=cfg_opt.b1, b2=cfg_opt.b2, eps=cfg_opt.eps,
                       weight_decay=cfg_opt.weight_decay, mask=mask)
  elif cfg_opt.name == "muon":
    adam_schedule = learning_rate_schedule(
        dict_to_cfg(cfg_opt, lr=cfg_opt.adam_lr), total_steps)
    core = optax.contrib.muon(
        schedule, beta=cfg_opt.muon_beta, weight_decay=cfg_opt.weight_decay, weight_decay_mask=mask,
        adam_b1=cfg_opt.b1, adam_b2=cfg_opt.b2, adam_weight_decay=cfg_opt.weight_decay,
        adam_learning_rate=adam_schedule, consistent_rms=cfg_opt.muon_consistent_rms,
        muon_weight_dimension_numbers=muon_dimension_numbers(logical_axes))
  else:
    raise ValueError(f"optim.name={cfg_opt.name!r}: expected 'adamw' or 'muon'")
  chain = [optax.clip_by_global_norm(cfg_opt.grad_clip)] if cfg_opt.grad_clip > 0 else []
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
  """
  flat = traverse_util.flatten_dict(params)
  for prefix, m_H in max_logits.items():
    factor_H = jnp.minimum(1.0, tau / jnp.maximum(m_H, 1e-6))
    for name, power in (("w_uq", alpha), ("w_uk", 1.0 - alpha)):
      key = (*prefix, name)
      w = flat[key]  # [lora, heads, head_dim]
      flat[key] = (w * (factor_H ** power)[None, :, None]).astype(w.dtype)
  return traverse_util.unflatten_dict(flat)
