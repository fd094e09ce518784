"""FLOP counts shared by the benchmarks: the chunked KDA form and causal softmax attention.

Forward FLOPs per token; a training step counts three times the forward (the backward as twice the
forward), without rematerialised recomputation.
"""


def kda_forward_flops_per_token(heads: int, k_dim: int, v_dim: int, chunk: int) -> float:
  """The chunked delta rule per token: intra-chunk scores and solve (2CK + C(K+V) + CV per token)
  and the state products (6KV per token: the state read by w and q, and its update)."""
  C, K, V = chunk, k_dim, v_dim
  per_chunk = 2 * C * C * K + C * C * (K + V) + 6 * C * K * V + C * C * V
  return heads * per_chunk / C


def causal_attention_forward_flops_per_token(heads: int, qk_dim: int, v_dim: int, seq_len: int) -> float:
  """QK^T and PV over a causal row of `seq_len`: each query sees (T + 1) / 2 keys on average. Packed
  documents are not subtracted: the fused kernels skip only the upper triangle."""
  return 2 * heads * (qk_dim + v_dim) * (seq_len + 1) / 2
