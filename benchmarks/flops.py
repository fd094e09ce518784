"""FLOP counts shared by the benchmarks: the chunked KDA form, causal softmax attention within documents,
and Muon's orthogonalisation.

Forward FLOPs per token; a training step counts three times the forward (the backward as twice the
forward), without rematerialised recomputation.
"""


from moejax.flops import (  # noqa: F401 - the benchmarks' imports of them
  causal_attention_forward_flops_per_token,
  kda_forward_flops_per_token,
  visible_keys_per_query,
)


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
