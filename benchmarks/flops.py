"""FLOP counts shared by the benchmarks: the chunked KDA form, causal softmax attention within documents,
and Muon's orthogonalisation.

Forward FLOPs per token; a training step counts three times the forward (the backward as twice the
forward), without rematerialised recomputation.
"""


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
  import numpy as np

  seg = np.asarray(segment_ids_BT)
  starts = np.concatenate([np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  pairs = 0
  for row in starts:
    lengths = np.diff(np.append(np.flatnonzero(row), row.size))
    pairs += int(np.sum(lengths * (lengths + 1) // 2))
  return pairs / seg.size


def newton_schulz_flops(shapes: list[tuple[int, int, int]], steps: int = 5, symmetric: bool = False) -> float:
  """Muon's quintic Newton-Schulz over (batch, rows, cols) matrices: per step, with m <= n the short
  side, X X^T (2 m^2 n), A A (2 m^3) and B X (2 m^2 n). `symmetric`: the two symmetric products made
  as their lower triangles (pallas_kernels/newton_schulz), half of each (its diagonal tiles aside)."""
  total = 0.0
  for batch, rows, cols in shapes:
    m, n = min(rows, cols), max(rows, cols)
    gram = m * m * n + m ** 3 if symmetric else 2 * m * m * n + 2 * m ** 3
    total += batch * steps * (gram + 2 * m * m * n)
  return total
