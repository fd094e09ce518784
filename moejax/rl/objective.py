"""The policy update's objective, in the train step's `LossFn` form (moejax.training.loss), and the
check that the trainer's log-probabilities are the rollout's.

The update batch (`moejax.rl.batch.update_batch`) holds, besides tokens, targets and segment ids:
  loss_mask   [B, T] float32  the aggregation weights of the policy's tokens (`grpo.aggregation_weights`)
  policy_mask [B, T] float32  1 where the target is a token the policy drew
  old_logp    [B, T] float32  the drawing policy's log-probability of the target
  advantages  [B]    float32
  fresh       [B, T] float32  1 where the current policy drew the target (no update since)
  ref_logp    [B, T] float32  the reference policy's, when grpo.kl_coef > 0
The train step splits a batch into passes by rows and weights each by its share of loss_mask, so the
objective is a loss_mask-weighted mean, as the contract asks.
"""

import jax.numpy as jnp

from moejax.rl.grpo import per_token_terms, weighted_mean
from moejax.rl.logprobs import token_logprobs


def policy_objective(grpo_cfg):
  """LossFn of the clipped policy gradient (`moejax.rl.grpo`), with its metrics: clip fraction, KL to
  the reference, entropy, the mean ratio and |logp - old_logp|."""
  def loss_fn(h_BTD, head_DV, batch, cfg_model):
    logp_BT, entropy_BT = token_logprobs(h_BTD, head_DV, batch["targets"], chunk=cfg_model.loss.chunk_tokens)
    ref = batch.get("ref_logp") if grpo_cfg.kl_coef > 0 else None
    loss_BT, clipped_BT, kl_BT = per_token_terms(
        logp_BT, batch["old_logp"], batch["advantages"], clip_low=grpo_cfg.clip_low,
        clip_high=grpo_cfg.clip_high, ref_logp_BT=ref, kl_coef=grpo_cfg.kl_coef)
    w_BT = batch["loss_mask"]
    mean = lambda x: weighted_mean(jnp.asarray(x, jnp.float32), w_BT)
    delta_BT = logp_BT - batch["old_logp"]
    metrics = {"policy_loss": mean(loss_BT), "clip_fraction": mean(clipped_BT), "kl": mean(kl_BT),
               "entropy": mean(entropy_BT), "ratio": mean(jnp.exp(delta_BT)),
               "abs_logp_change": mean(jnp.abs(delta_BT)), "tokens": jnp.sum(batch["policy_mask"])}
    return mean(loss_BT), metrics
  return loss_fn


def mismatch_objective(h_BTD, head_DV, batch, cfg_model):
  """LossFn whose metrics compare the trainer's log-probabilities of the policy's tokens with the
  rollout's, over the tokens the current policy drew (`fresh`): mean and max |delta logp|. Run by an
  eval step before the batch's first update; with the same weights and float32 it is ~0, and what it
  shows beyond that is the difference between the cached decode path and the training forward."""
  logp_BT, _ = token_logprobs(h_BTD, head_DV, batch["targets"], chunk=cfg_model.loss.chunk_tokens)
  fresh = batch["fresh"]
  delta = jnp.abs(logp_BT - batch["old_logp"]) * fresh
  return jnp.zeros((), jnp.float32), {"logp_mismatch": jnp.sum(delta) / jnp.maximum(jnp.sum(fresh), 1.0),
                                      "logp_mismatch_max": jnp.max(delta)}
