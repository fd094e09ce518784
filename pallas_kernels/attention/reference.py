"""Dense reference of per-document attention, causal or bidirectional: the [T, T] logits in full, for tests
and for short rows. Documents are runs of equal consecutive segment ids (pallas_kernels.segments)."""

import jax
import jax.numpy as jnp

from pallas_kernels.segments import document_ids


def document_attention_reference(q_BTHD, k_BTHD, v_BTHV, segment_ids_BT=None, *, scale: float,
                                 causal: bool = True, return_max_logit: bool = False):
  """softmax(scale q k^T) v over keys j <= i of query i's document (causal=False: every key of that
  document), computed in the inputs' precision (pass float64 or float32 for a reference).
  return_max_logit: also the per-head largest visible logit, float32 [H], without gradient."""
  B, T = q_BTHD.shape[:2]
  doc_BT = jnp.zeros((B, T), jnp.int32) if segment_ids_BT is None else document_ids(segment_ids_BT)
  logits_BHTS = jnp.einsum("bthd,bshd->bhts", q_BTHD, k_BTHD,
                           precision=jax.lax.Precision.HIGHEST) * scale
  keep_BTS = doc_BT[:, :, None] == doc_BT[:, None, :]
  if causal:
    keep_BTS &= (jnp.arange(T)[:, None] >= jnp.arange(T)[None, :])[None]
  keep_B1TS = keep_BTS[:, None]
  logits_BHTS = jnp.where(keep_B1TS, logits_BHTS, -jnp.inf)
  p_BHTS = jax.nn.softmax(logits_BHTS, axis=-1)
  o_BTHV = jnp.einsum("bhts,bshv->bthv", p_BHTS, v_BTHV, precision=jax.lax.Precision.HIGHEST)
  if not return_max_logit:
    return o_BTHV
  max_H = jnp.max(jax.lax.stop_gradient(logits_BHTS), axis=(0, 2, 3)).astype(jnp.float32)
  return o_BTHV, max_H
