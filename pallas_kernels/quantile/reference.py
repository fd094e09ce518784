"""Reference (XLA) pieces of the exact quantile balance (docs/design.md §5, moejax/moe/balance.py): the choice
margins and the per-column exact threshold. The Pallas kernels (kernel.py) must match them bit for bit, and
they are what runs off the GPU."""

import jax
import jax.numpy as jnp


def choice_margins(scores_MN, bias_N, k: int):
  """c_ij = s_ij - (k-th largest of s_il + b_l over l != j): j is chosen iff c_ij > -b_j."""
  v_MN = scores_MN + bias_N
  # The barrier keeps XLA:CPU from rewriting top_k + two column slices into a full sort (30x slower).
  top_MK1 = jax.lax.optimization_barrier(jax.lax.top_k(v_MN, k + 1)[0])
  kth_M, next_M = top_MK1[:, k - 1], top_MK1[:, k]
  chosen_MN = v_MN >= kth_M[:, None]
  return scores_MN - jnp.where(chosen_MN, next_M[:, None], kth_M[:, None])


def threshold_rank(m: int, num_above: float) -> int:
  """q = round(num_above) clipped to [1, m - 1]: the rank whose entry, with the next one, brackets the
  threshold (needs m >= 2)."""
  return min(max(round(num_above), 1), m - 1)


def exact_threshold(values_MN, num_above: float):
  """Per column, the midpoint between the q-th and (q+1)-th largest entries, q = round(num_above):
  exactly q entries exceed it (barring ties)."""
  m = values_MN.shape[0]
  if m == 1:
    return values_MN[0]
  q = threshold_rank(m, num_above)
  v_MN = values_MN.astype(jnp.float32)
  key_MN = ordered_key(v_MN)
  kth_N = kth_largest_key(key_MN, q)
  # The (q+1)-th largest: the q-th itself when it is tied, else the largest entry below it.
  ties_N = jnp.sum(key_MN >= kth_N, axis=0) > q
  below_N = jnp.max(jnp.where(key_MN < kth_N, v_MN, -jnp.inf), axis=0)
  kth_value_N = key_value(kth_N)
  return 0.5 * (kth_value_N + jnp.where(ties_N, kth_value_N, below_N))


def ordered_key(x):
  """uint32 keys of float32 x whose unsigned order is the order of the values (NaN excepted)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def key_value(key):
  """The float32 whose ordered_key is `key`."""
  bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


RADIX_BITS = 4


def kth_largest_key(key_MN, q: int):
  """Per column, the q-th largest uint32 key (1 <= q <= rows), by radix selection from the top bit:
  each of 32 / RADIX_BITS passes counts, per column, the keys at or above the 2^RADIX_BITS candidates
  that extend the prefix found so far, and keeps the largest candidate with q or more. One fused
  compare-and-count per pass, where lax.top_k of k ~ m*k/n entries per column sorts the column (on
  the H200 step those sorts, one per sweep and MoE layer, took 11.7 ms)."""
  digits = 1 << RADIX_BITS
  prefix_N = jnp.zeros(key_MN.shape[1:], jnp.uint32)
  for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
    cand_DN = prefix_N[None] | (jnp.arange(digits, dtype=jnp.uint32)[:, None] << shift)
    count_DN = jnp.sum(key_MN[:, None, :] >= cand_DN[None], axis=0, dtype=jnp.int32)
    # Counts fall as the candidate grows, and candidate 0 (the prefix) always has q or more.
    digit_N = jnp.sum(count_DN >= q, axis=0, dtype=jnp.int32) - 1
    prefix_N = prefix_N | (digit_N.astype(jnp.uint32) << shift)
  return prefix_N
