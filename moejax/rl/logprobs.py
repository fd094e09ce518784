"""Log-probabilities of given tokens under the model, and the entropy of its distribution, computed
over sequence chunks so that no [B, T, vocab] logits array is held: at T = 8K and a 160K vocabulary
that would be 5 GiB a row in float32. Each chunk is rematerialised in the backward pass."""

import jax
import jax.numpy as jnp


def _chunk(h_BCD, w_DV, targets_BC):
  logits_BCV = jnp.dot(h_BCD, w_DV.astype(h_BCD.dtype), preferred_element_type=jnp.float32)
  logp_BCV = jax.nn.log_softmax(logits_BCV, axis=-1)
  logp_BC = jnp.take_along_axis(logp_BCV, targets_BC[..., None], axis=-1)[..., 0]
  entropy_BC = -jnp.sum(jnp.exp(logp_BCV) * logp_BCV, axis=-1)
  return logp_BC, jax.lax.stop_gradient(entropy_BC)


def token_logprobs(h_BTD, head_DV, targets_BT, *, chunk: int = 2048):
  """(logp_BT, entropy_BT), float32: log p(targets_BT[b, t] | h_BTD[b, t]) under the head's softmax,
  differentiable in h and the head, and the distribution's entropy (not differentiated)."""
  B, T, _ = h_BTD.shape
  if targets_BT.shape != (B, T):
    raise ValueError(f"targets {targets_BT.shape} do not match hidden states {h_BTD.shape[:2]}")
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1, got {chunk}")
  chunk = min(chunk, T)
  pad = (-T) % chunk
  h = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0)))
  t = jnp.pad(targets_BT, ((0, 0), (0, pad)))
  n = (T + pad) // chunk
  split = lambda x: jnp.moveaxis(x.reshape(B, n, chunk, *x.shape[2:]), 1, 0)
  body = jax.checkpoint(lambda h_BCD, t_BC: _chunk(h_BCD, head_DV, t_BC))
  _, (logp_NBC, entropy_NBC) = jax.lax.scan(lambda c, xs: (c, body(*xs)), None, (split(h), split(t)))
  merge = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, n * chunk)[:, :T]
  return merge(logp_NBC), merge(entropy_NBC)
