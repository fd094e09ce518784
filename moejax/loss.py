"""Next-token cross-entropy with optional z-loss, computed over sequence chunks.

The head is applied to `chunk` tokens at a time inside a rematerialised scan, so a [B,T,V] logits
array never exists: at T=1M and V=160K it would take 640 GB in float32.
"""

import jax
import jax.numpy as jnp


def _chunk_terms(h_BCD, w_DV, targets_BC, mask_BC):
  logits_BCV = jnp.dot(h_BCD, w_DV.astype(h_BCD.dtype), preferred_element_type=jnp.float32)
  lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
  target_logit_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
  nll = jnp.sum((lse_BC - target_logit_BC) * mask_BC)
  z = jnp.sum(jnp.square(lse_BC) * mask_BC)
  return nll, z


def cross_entropy(h_BTD, w_DV, targets_BT, loss_mask_BT=None, *, z_loss_weight: float = 0.0,
                  chunk: int = 2048):
  """Mean masked NLL (+ z_loss_weight * mean logsumexp^2); returns (loss, metrics dict).

  The z-loss keeps the softmax normaliser near one, which stabilises bf16 logits late in training.
  """
  B, T, _ = h_BTD.shape
  if targets_BT.shape != (B, T):
    raise ValueError(f"targets shape {targets_BT.shape} does not match hidden states {h_BTD.shape[:2]}")
  mask_BT = jnp.ones((B, T), jnp.float32) if loss_mask_BT is None else loss_mask_BT.astype(jnp.float32)
  chunk = min(chunk, T)
  pad = (-T) % chunk
  if pad:
    h_BTD = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0)))
    targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
    mask_BT = jnp.pad(mask_BT, ((0, 0), (0, pad)))
  n = (T + pad) // chunk
  split = lambda x: jnp.moveaxis(x.reshape(B, n, chunk, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def body(carry, xs):
    nll, z = _chunk_terms(*xs[:1], w_DV, *xs[1:])
    return (carry[0] + nll, carry[1] + z), None

  zero = jnp.zeros((), jnp.float32)
  (nll, z), _ = jax.lax.scan(body, (zero, zero), (split(h_BTD), split(targets_BT), split(mask_BT)))
  count = jnp.maximum(jnp.sum(mask_BT), 1.0)
  nll, z = nll / count, z / count
  loss = nll + z_loss_weight * z
  return loss, {"nll": nll, "z_loss": z, "tokens": jnp.sum(mask_BT)}
