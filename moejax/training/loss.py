"""Next-token cross-entropy with optional z-loss, computed over sequence chunks, its gradient made in
the same pass.

The head is applied to `chunk` positions at a time inside a scan, so a [B,T,V] logits array never
exists: at T=1M and V=160K it would take 640 GB in float32. Under differentiation the forward pass
also makes the gradients: the loss is a scalar at the end of the graph, so with the logits of a chunk
at hand, d loss / d logits = (softmax (1 + 2 z lse) - onehot) * mask / count is known, and dh and dW
follow from two matmuls. The backward pass then only scales them by the incoming cotangent. Against
differentiating a rematerialised scan this saves one of the four matmuls and two passes over the
chunk's logits.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


def _logits(h_BCD, w_DV):
  return jnp.dot(h_BCD, w_DV.astype(h_BCD.dtype), preferred_element_type=jnp.float32)


def logsumexp_one_pass(x):
  """logsumexp over the last axis in one reduction, float32: (max, sum of exp(x - max)) pairs merged
  as (m, s) + (m', s') = (M, s e^(m - M) + s' e^(m' - M)), M = max(m, m'). jax.nn.logsumexp reads x
  twice, for its max and then for its sum; over a chunk of float32 logits each read is 1 GiB in the
  H200 step (4 x 2048 rows, 32K vocabulary), a quarter of the loss's traffic. The starting max is
  the lowest finite float32, not -inf, so that merging two empty pairs gives 0 * e^0, not NaN."""
  x = x.astype(jnp.float32)

  def merge(a, b):
    (m_a, s_a), (m_b, s_b) = a, b
    m = jnp.maximum(m_a, m_b)
    return m, s_a * jnp.exp(m_a - m) + s_b * jnp.exp(m_b - m)

  lowest = jnp.float32(jnp.finfo(jnp.float32).min)
  m, s = jax.lax.reduce((x, jnp.ones_like(x)), (lowest, jnp.float32(0)), merge, (x.ndim - 1,))
  return m + jnp.log(s)


def _chunk_terms(h_BCD, w_DV, targets_BC, mask_BC):
  """Masked sums of the NLL and of lse^2 over one chunk, and its logits and lse."""
  logits_BCV = _logits(h_BCD, w_DV)
  lse_BC = logsumexp_one_pass(logits_BCV)
  target_logit_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
  nll = jnp.sum((lse_BC - target_logit_BC) * mask_BC)
  z = jnp.sum(jnp.square(lse_BC) * mask_BC)
  return nll, z, logits_BCV, lse_BC


def _split(x, n: int, chunk: int):
  """[B, n*chunk, ...] -> [n, B, chunk, ...]."""
  return jnp.moveaxis(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _loss_sums(h_NBCD, w_DV, targets_NBC, mask_NBC, z_weight: float):
  """(loss, nll, z): loss = (nll + z_weight * z) / count, nll and z the masked means. Only `loss` is
  differentiated (the wrapper stops the gradient of the other two)."""
  def body(carry, xs):
    nll, z, _, _ = _chunk_terms(xs[0], w_DV, *xs[1:])
    return (carry[0] + nll, carry[1] + z), None

  zero = jnp.zeros((), jnp.float32)
  (nll, z), _ = jax.lax.scan(body, (zero, zero), (h_NBCD, targets_NBC, mask_NBC))
  count = jnp.maximum(jnp.sum(mask_NBC), 1.0)
  return (nll + z_weight * z) / count, nll / count, z / count


def _loss_sums_fwd(h_NBCD, w_DV, targets_NBC, mask_NBC, z_weight):
  count = jnp.maximum(jnp.sum(mask_NBC), 1.0)
  dtype = h_NBCD.dtype
  w_cDV = w_DV.astype(dtype)

  def body(carry, xs):
    nll_sum, z_sum, dw_DV = carry
    h_BCD, targets_BC, mask_BC = xs
    nll, z, logits_BCV, lse_BC = _chunk_terms(h_BCD, w_DV, targets_BC, mask_BC)
    p_BCV = jnp.exp(logits_BCV - lse_BC[..., None])
    onehot_BCV = jax.nn.one_hot(targets_BC, logits_BCV.shape[-1], dtype=jnp.float32)
    scale_BC = mask_BC / count
    dlogits_BCV = ((p_BCV * (1.0 + 2.0 * z_weight * lse_BC)[..., None] - onehot_BCV)
                   * scale_BC[..., None]).astype(dtype)
    dh_BCD = jnp.einsum("bcv,dv->bcd", dlogits_BCV, w_cDV, preferred_element_type=jnp.float32)
    dw_DV = dw_DV + jnp.einsum("bcd,bcv->dv", h_BCD, dlogits_BCV, preferred_element_type=jnp.float32)
    return (nll_sum + nll, z_sum + z, dw_DV), dh_BCD.astype(dtype)

  zero = jnp.zeros((), jnp.float32)
  (nll, z, dw_DV), dh_NBCD = jax.lax.scan(
      body, (zero, zero, jnp.zeros(w_DV.shape, jnp.float32)), (h_NBCD, targets_NBC, mask_NBC))
  out = ((nll + z_weight * z) / count, nll / count, z / count)
  return out, (dh_NBCD, dw_DV.astype(w_DV.dtype), mask_NBC)


def _loss_sums_bwd(z_weight, residuals, cotangents):
  dh_NBCD, dw_DV, mask_NBC = residuals
  g = cotangents[0]  # those of nll and z are zero: the wrapper stops their gradient
  return ((g * dh_NBCD).astype(dh_NBCD.dtype), (g * dw_DV).astype(dw_DV.dtype), None,
          jnp.zeros_like(mask_NBC))


_loss_sums.defvjp(_loss_sums_fwd, _loss_sums_bwd)


def cross_entropy(h_BTD, w_DV, targets_BT, loss_mask_BT=None, *, z_loss_weight: float = 0.0,
                  chunk: int = 2048):
  """Mean masked NLL (+ z_loss_weight * mean logsumexp^2); returns (loss, metrics dict).

  Differentiable in h_BTD and w_DV (not in the mask). The z-loss keeps the softmax normaliser near one,
  which stabilises bf16 logits late in training.
  """
  B, T, _ = h_BTD.shape
  if targets_BT.shape != (B, T):
    raise ValueError(f"targets shape {targets_BT.shape} does not match hidden states {h_BTD.shape[:2]}")
  if h_BTD.shape[-1] != w_DV.shape[0]:
    raise ValueError(f"head matrix {w_DV.shape} does not take hidden states of width {h_BTD.shape[-1]}")
  if chunk < 1:
    raise ValueError(f"loss chunk must be >= 1, got {chunk}")
  mask_BT = jnp.ones((B, T), jnp.float32) if loss_mask_BT is None else loss_mask_BT.astype(jnp.float32)
  chunk = min(chunk, T)
  pad = (-T) % chunk
  if pad:
    h_BTD = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0)))
    targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
    mask_BT = jnp.pad(mask_BT, ((0, 0), (0, pad)))
  n = (T + pad) // chunk
  loss, nll, z = _loss_sums(_split(h_BTD, n, chunk), w_DV, _split(targets_BT, n, chunk),
                            _split(mask_BT, n, chunk), float(z_loss_weight))
  metrics = {"nll": jax.lax.stop_gradient(nll), "z_loss": jax.lax.stop_gradient(z),
             "tokens": jnp.sum(mask_BT)}
  return loss, metrics


# The objective a train or eval step optimises: (final hidden states [B,T,D], the head matrix [D,V], the
# batch, config.model) -> (loss, metrics). The step splits a batch into passes and weights each pass by
# its share of batch["loss_mask"], so a loss must be a mean over that mask's weight. Its metrics combine
# over passes the same way (per-token means), except "tokens", which is summed.
LossFn = Callable[..., tuple[jax.Array, dict]]


def next_token_loss(h_BTD, head_DV, batch, cfg_model):
  """Pretraining's objective: next-token `cross_entropy` over batch["targets"] under batch["loss_mask"],
  with model.loss's z-loss weight and chunk."""
  return cross_entropy(h_BTD, head_DV, batch["targets"], batch["loss_mask"],
                       z_loss_weight=cfg_model.loss.z_loss_weight, chunk=cfg_model.loss.chunk_tokens)
