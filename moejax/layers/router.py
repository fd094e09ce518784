"""Sigmoid router: top-k selection on biased scores, mixture weights from unbiased ones (DESIGN §5).

All functions act on one shard of tokens; under shard_map the caller reduces the returned sums.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.segments import document_ids


def router_scores(x_MD, w_DE):
  """s = sigmoid(x W_r), in float32 whatever the compute dtype: the top-k is sensitive to rounding."""
  logits_ME = jnp.dot(x_MD.astype(jnp.float32), w_DE.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
  return jax.nn.sigmoid(logits_ME)


def select_experts(s_ME, bias_E, k: int, scaling: float):
  """Top-k of s + bias; weights are the chosen unbiased scores, normalised over k, times `scaling`.

  The bias only moves the selection: it gets no gradient.
  """
  _, idx_MK = jax.lax.top_k(s_ME + jax.lax.stop_gradient(bias_E), k)
  s_MK = jnp.take_along_axis(s_ME, idx_MK, axis=1)
  p_MK = s_MK / jnp.sum(s_MK, axis=1, keepdims=True) * scaling
  return idx_MK.astype(jnp.int32), p_MK


def expert_load(idx_MK, num_experts: int):
  """Tokens routed to each expert, float32 [E]."""
  return jnp.bincount(idx_MK.reshape(-1), length=num_experts).astype(jnp.float32)


def sequence_aux_loss_terms(s_ME, idx_MK, segment_ids_BT, k: int):
  """Sequence-wise balance loss (DeepSeek-V3), summed over documents, and the document count.

  Per document of T' tokens: f_j = n/(k T') * #{tokens choosing j}, P_j = mean over tokens of
  s_tj / sum_l s_tl, loss = sum_j f_j P_j (1 when perfectly balanced). A document is a run of equal
  segment ids in a row, or the whole row when `segment_ids_BT` is None. The caller divides the sum
  by the count (after reducing both over shards) and applies the weight.
  """
  b, t = segment_ids_BT.shape
  m, n = s_ME.shape
  doc_M = (jnp.arange(b, dtype=jnp.int32)[:, None] * t + document_ids(segment_ids_BT)).reshape(m)
  chosen_ME = jnp.zeros((m, n), jnp.float32).at[jnp.arange(m)[:, None], idx_MK].set(1.0)
  share_ME = s_ME / jnp.sum(s_ME, axis=1, keepdims=True)
  seg_sum = lambda a: jax.ops.segment_sum(a, doc_M, num_segments=m)
  chosen_GE, share_GE = seg_sum(chosen_ME), seg_sum(share_ME)
  tokens_G = seg_sum(jnp.ones((m,), jnp.float32))
  per_doc_G = (n / k) * jnp.sum(chosen_GE * share_GE, axis=1) / jnp.maximum(tokens_G, 1.0) ** 2
  return jnp.sum(per_doc_G), jnp.sum(tokens_G > 0).astype(jnp.float32)
