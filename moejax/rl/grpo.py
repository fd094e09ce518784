"""The clipped policy-gradient loss of GRPO/DAPO, and the train step's objective built on it.

Per token, with ratio r = exp(logp - old_logp) and A the sequence's advantage:
  loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))         (PPO's pessimistic bound)
       + kl_coef (exp(ref - logp) - (ref - logp) - 1)                 (k3, the low-variance KL estimate)
The asymmetric clip (clip_high > clip_low) is DAPO's "clip-higher": it lets unlikely tokens gain more
probability before the clip stops them. See docs/rl.md for the aggregations.
"""

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token-mean", "sequence-mean")


def per_token_terms(logp_BT, old_logp_BT, advantages_B, *, clip_low: float, clip_high: float,
                    ref_logp_BT=None, kl_coef: float = 0.0):
  """(loss_BT, clipped_BT, kl_BT) before masking: each token's loss, whether the clip decided it (its
  gradient is zero), and its KL estimate (zeros without a reference)."""
  if clip_low < 0 or clip_high < 0 or clip_low >= 1:
    raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
  logp_BT = logp_BT.astype(jnp.float32)
  a_BT = jnp.asarray(advantages_B, jnp.float32)[:, None]
  ratio = jnp.exp(logp_BT - old_logp_BT.astype(jnp.float32))
  unclipped, clipped = -a_BT * ratio, -a_BT * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  loss_BT = jnp.maximum(unclipped, clipped)
  clipped_BT = clipped > unclipped
  kl_BT = jnp.zeros_like(logp_BT)
  if ref_logp_BT is not None:
    d = ref_logp_BT.astype(jnp.float32) - logp_BT
    kl_BT = jnp.exp(d) - d - 1.0
    loss_BT = loss_BT + kl_coef * kl_BT
  elif kl_coef:
    raise ValueError("kl_coef > 0 needs ref_logp_BT, the reference policy's log-probabilities")
  return loss_BT, clipped_BT, kl_BT


def aggregation_weights(mask_BT, aggregation: str):
  """[B, T] float32 weights w with loss = sum(w * loss_BT) / max(sum(w), 1):
  "token-mean" (DAPO): the mask itself, every loss token of the batch weighs the same;
  "sequence-mean" (GRPO): mask / the sequence's loss tokens, each sequence weighs the same (sum(w) is
  the number of sequences with a loss token)."""
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
  m = mask_BT.astype(jnp.float32)
  if aggregation == "token-mean":
    return m
  return m / jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1.0)


def weighted_mean(x_BT, w_BT):
  return jnp.sum(x_BT * w_BT) / jnp.maximum(jnp.sum(w_BT), 1.0)


def grpo_loss(logp_BT, old_logp_BT, advantages_B, mask_BT, *, clip_low: float = 0.2, clip_high: float = 0.28,
              ref_logp_BT=None, kl_coef: float = 0.0, aggregation: str = "token-mean"):
  """The scalar loss of a batch of sampled sequences: `per_token_terms` averaged over mask_BT's tokens
  by `aggregation` ("token-mean" or "sequence-mean"). logp_BT are differentiated; old_logp_BT (the
  sampling policy's) and ref_logp_BT are constants. A batch without loss tokens has loss 0."""
  if logp_BT.shape != old_logp_BT.shape or logp_BT.shape != mask_BT.shape:
    raise ValueError(f"logp {logp_BT.shape}, old_logp {old_logp_BT.shape} and mask {mask_BT.shape} differ")
  if jnp.shape(advantages_B) != logp_BT.shape[:1]:
    raise ValueError(f"advantages {jnp.shape(advantages_B)} do not match batch {logp_BT.shape[:1]}")
  ref = None if ref_logp_BT is None else jax.lax.stop_gradient(ref_logp_BT)
  loss_BT, _, _ = per_token_terms(logp_BT, jax.lax.stop_gradient(old_logp_BT), advantages_B,
                                  clip_low=clip_low, clip_high=clip_high, ref_logp_BT=ref, kl_coef=kl_coef)
  return weighted_mean(loss_BT, aggregation_weights(mask_BT, aggregation))
