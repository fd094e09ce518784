"""FLOP counts shared by the benchmarks: the chunked KDA form, causal softmax attention, and Muon's
orthogonalisation.

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
