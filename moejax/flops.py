"""Model FLOPs, counted as the kernels compute them, and the cards' data-sheet peaks: for the MFU the
training loop reports (moejax.training.loop) and the benchmarks print.

Forward FLOPs per token; a training step counts three times the forward (the backward as twice the
forward), without rematerialised recomputation. Attention counts only the (query, key) pairs within
documents, which is what the packed-document kernels compute.
"""

import jax
import numpy as np

from moejax.layout import SCANNED, layer_kinds


def kda_forward_flops_per_token(heads: int, k_dim: int, v_dim: int, chunk: int) -> float:
  """The chunked delta rule per token: intra-chunk scores and solve (2CK + C(K+V) + CV per token)
  and the state products (6KV per token: the state read by w and q, and its update)."""
  C, K, V = chunk, k_dim, v_dim
  per_chunk = 2 * C * C * K + C * C * (K + V) + 6 * C * K * V + C * C * V
  return heads * per_chunk / C


def causal_attention_forward_flops_per_token(heads: int, qk_dim: int, v_dim: int,
                                             keys_per_query: float) -> float:
  """QK^T and PV where a query sees `keys_per_query` keys on average: (T + 1) / 2 for one causal row
  of T tokens, fewer for packed documents (`visible_keys_per_query`)."""
  return 2 * heads * (qk_dim + v_dim) * keys_per_query


def visible_keys_per_query(segment_ids_BT) -> float:
  """The mean number of keys a query attends to under causal attention within documents: a document
  of L tokens holds L (L + 1) / 2 (query, key) pairs. What the document-attention kernels compute on
  packed rows, where causal attention over the whole row would count pairs across documents too."""
  seg = np.asarray(segment_ids_BT)
  starts = np.concatenate([np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  pairs = 0
  for row in starts:
    lengths = np.diff(np.append(np.flatnonzero(row), row.size))
    pairs += int(np.sum(lengths * (lengths + 1) // 2))
  return pairs / seg.size


def model_flops_per_token(config, params, segment_ids_BT) -> dict:
  """Training FLOPs per token by part (3 x forward) of a batch packed as `segment_ids_BT`: MLA's
  attention counts the (query, key) pairs within documents, which is what its kernels compute."""
  return flop_counter(config, params)(segment_ids_BT)


def flop_counter(config, params):
  """`model_flops_per_token` with what does not depend on the batch (the weights' matmuls, KDA's
  chunked form) counted once: a function of `segment_ids_BT`, for a loop that counts every step."""
  m, e = config.model, config.model.moe
  matmul = 0.0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [str(getattr(k, "key", k)) for k in path]
    if leaf.ndim - (keys[0] == SCANNED) < 2 or (keys[-1] == "embedding" and not m.tie_embeddings):
      continue
    share = e.top_k / e.num_experts if keys[-1].startswith("expert_") else 1.0
    matmul += 2 * leaf.size * share
  kinds = [mixer for mixer, _ in layer_kinds(m)]
  kda = kinds.count("kda") * kda_forward_flops_per_token(m.kda.num_heads, m.kda.head_k_dim,
                                                          m.kda.head_v_dim, m.kda.chunk_size)

  def count(segment_ids_BT) -> dict:
    mla = kinds.count("mla") * causal_attention_forward_flops_per_token(
        m.mla.num_heads, m.mla.qk_nope_head_dim, m.mla.v_head_dim, visible_keys_per_query(segment_ids_BT))
    parts = {"matmul weights": 3 * matmul, "KDA chunked form": 3 * kda, "MLA attention": 3 * mla}
    return {**parts, "total": sum(parts.values())}

  return count


# Dense bf16 tensor-core peaks of the cards' data sheets (SXM parts; without sparsity), FLOP/s, by a
# substring of jax's device_kind.
SPEC_BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12}


def spec_bf16_peak(device_kind: str) -> float | None:
  """The data-sheet dense bf16 peak of a device, or None where this table does not know the card."""
  for name, peak in SPEC_BF16_PEAK.items():
    if name in device_kind and "PCIe" not in device_kind:
      return peak
  return None
