"""Expert load balancing as routing state (DESIGN §5): quantile bias, sign bias, and their updates.

The state of every MoE layer lives in the Flax collection "balance", next to the params:

  bias        [n] float32  added to the router scores for top-k selection only (no gradient);
  load_total  [n] float32  tokens routed to each expert, summed over every step so far, for
                           MaxVio_global (`moejax.metrics`).

Each call of the layer sows per-batch statistics into the collection "router" (`moejax.layers.moe`):
`load` [n], `dropped` (expert-parallel capacity overflow), `bias_next` [n] for "quantile" and the
weighted `aux_loss` for "aux". Once per train step, `next_balance_state` folds them into the state.
The bias computed from batch t is only used from batch t+1 on, so routing stays causal.

Quantile balancing, with target load q = m*k/n per expert:
  c_ij = s_ij - t_ij, where t_ij is the k-th largest biased score among the *other* experts of token i,
         so expert j is chosen by token i exactly when c_ij > -b_j (given the other biases);
  b_j  = -(the value that q of the margins c_:j exceed), then b <- b - mean(b); repeat.
t_ij is the (k+1)-th largest biased score for the experts token i chooses and the k-th largest for
the rest. DESIGN §5 uses the (k+1)-th for all of them; that overstates the margin of unchosen experts
and converges far slower: on strongly skewed batches (m=4096, n=256, k=8) this form reaches
MaxVio <= 0.05 from zero bias in 5-10 sweeps, where that one is still at 0.1-0.4 after 16. From the
previous batch's bias (the warm start used in training) a few sweeps suffice.

Under data parallelism the per-column quantile comes from histograms whose bin counts are summed over
the token axes (`histogram_threshold` with `axis_name`), so no shard sees another's scores.
"""

from collections.abc import Mapping

import jax
import jax.numpy as jnp

BALANCE_MODES = ("quantile", "sign", "aux", "none")


def _check_scores(scores_MN, k):
  if scores_MN.ndim != 2:
    raise ValueError(f"scores must be [tokens, experts], got shape {scores_MN.shape}")
  n = scores_MN.shape[1]
  if not 1 <= k <= n:
    raise ValueError(f"top-k k={k} must be in [1, num_experts={n}]")


def choice_margins(scores_MN, bias_N, k: int):
  """c_ij = s_ij - (k-th largest of s_il + b_l over l != j): j is chosen iff c_ij > -b_j."""
  v_MN = scores_MN + bias_N
  # The barrier keeps XLA:CPU from rewriting top_k + two column slices into a full sort (30x slower).
  top_MK1 = jax.lax.optimization_barrier(jax.lax.top_k(v_MN, k + 1)[0])
  kth_M, next_M = top_MK1[:, k - 1], top_MK1[:, k]
  chosen_MN = v_MN >= kth_M[:, None]
  return scores_MN - jnp.where(chosen_MN, next_M[:, None], kth_M[:, None])


def exact_threshold(values_MN, num_above: float):
  """Per column, the midpoint between the q-th and (q+1)-th largest entries, q = round(num_above):
  exactly q entries exceed it (barring ties)."""
  m = values_MN.shape[0]
  if m == 1:
    return values_MN[0]
  q = min(max(round(num_above), 1), m - 1)
  v_MN = values_MN.astype(jnp.float32)
  key_MN = _ordered_key(v_MN)
  kth_N = kth_largest_key(key_MN, q)
  # The (q+1)-th largest: the q-th itself when it is tied, else the largest entry below it.
  ties_N = jnp.sum(key_MN >= kth_N, axis=0) > q
  below_N = jnp.max(jnp.where(key_MN < kth_N, v_MN, -jnp.inf), axis=0)
  kth_value_N = _key_value(kth_N)
  return 0.5 * (kth_value_N + jnp.where(ties_N, kth_value_N, below_N))


def _ordered_key(x):
  """uint32 keys of float32 x whose unsigned order is the order of the values (NaN excepted)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _key_value(key):
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


def histogram_threshold(values_MN, num_above, bins: int, axis_name=None):
  """Per column, the value that `num_above` entries exceed, from a `bins`-bin histogram.

  Inside shard_map, pass the token axes as `axis_name`: the column ranges (pmin/pmax) and the bin
  counts (psum) are reduced over them, and `num_above` counts entries of all shards. The result lies
  in the bin of the exact quantile, so it is within one bin width (range / bins) of it; within that
  bin it is linearly interpolated.
  """
  m, n = values_MN.shape
  v_MN = values_MN.astype(jnp.float32)
  lo_N, hi_N = v_MN.min(axis=0), v_MN.max(axis=0)
  if axis_name is not None:
    lo_N, hi_N = jax.lax.pmin(lo_N, axis_name), jax.lax.pmax(hi_N, axis_name)
  width_N = jnp.maximum(hi_N - lo_N, 1e-12) / bins
  bin_MN = jnp.clip(jnp.floor((v_MN - lo_N) / width_N).astype(jnp.int32), 0, bins - 1)
  flat = (jnp.arange(n, dtype=jnp.int32)[None, :] * bins + bin_MN).reshape(-1)
  counts_NB = jnp.bincount(flat, length=n * bins).reshape(n, bins).astype(jnp.int32)
  if axis_name is not None:
    counts_NB = jax.lax.psum(counts_NB, axis_name)
  cum_NB = jnp.cumsum(counts_NB, axis=1)
  above_NB = (cum_NB[:, -1:] - cum_NB).astype(jnp.float32)  # entries in higher bins
  at_or_above_NB = above_NB + counts_NB
  # The crossing bin: the last one whose lower edge still has >= num_above entries at or above it.
  crossing_N = jnp.maximum(jnp.sum(at_or_above_NB >= num_above, axis=1) - 1, 0)
  pick = lambda a_NB: jnp.take_along_axis(a_NB, crossing_N[:, None], axis=1)[:, 0]
  in_bin_N = jnp.maximum(pick(counts_NB).astype(jnp.float32), 1.0)
  frac_N = jnp.clip((num_above - pick(above_NB)) / in_bin_N, 0.0, 1.0)
  return lo_N + width_N * (crossing_N + 1 - frac_N)


def quantile_bias(scores, k: int, bias=None, iters: int = 4, *, bins: int | None = None,
                  axis_name=None):
  """Mean-zero bias b [n] so that top-k of (scores + b) gives every expert about m*k/n tokens.

  scores [m, n] in (0, 1) (the router's sigmoid; no gradient flows through). `bias` warm-starts the
  alternation (the previous batch's bias is a good start). `bins=None` uses the exact quantile;
  `bins=B` the histogram, which is what runs under data parallelism, with the token axes as
  `axis_name` (inside shard_map; then m counts the tokens of all shards).
  """
  _check_scores(scores, k)
  if iters < 1:
    raise ValueError(f"quantile_bias needs iters >= 1, got {iters}")
  if axis_name is not None and bins is None:
    raise ValueError("quantile_bias over sharded tokens (axis_name set) needs the histogram: pass bins")
  s_MN = jax.lax.stop_gradient(scores).astype(jnp.float32)
  m, n = s_MN.shape
  b_N = jnp.zeros((n,), jnp.float32) if bias is None else jnp.asarray(bias, jnp.float32)
  if b_N.shape != (n,):
    raise ValueError(f"bias shape {b_N.shape} does not match {n} experts")
  if k == n:  # every token takes every expert: nothing to balance
    return jnp.zeros_like(b_N)
  m_total = m if axis_name is None else jax.lax.psum(m, axis_name)
  num_above = m_total * k / n
  for _ in range(iters):
    c_MN = choice_margins(s_MN, b_N, k)
    if bins is None:
      t_N = exact_threshold(c_MN, num_above)
    else:
      t_N = histogram_threshold(c_MN, num_above, bins, axis_name)
    b_N = -t_N
    b_N = b_N - jnp.mean(b_N)
  return b_N


def sign_update(bias_N, load_N, rate: float):
  """DeepSeek-V3: b_j += rate * sign(mean load - load_j), over the last axis."""
  mean = jnp.mean(load_N, axis=-1, keepdims=True)
  return bias_N + rate * jnp.sign(mean - load_N)


def _updated_layer(mode, state, stats, cfg_moe, path):
  if "load" not in stats:
    raise KeyError(f"router stats at {'/'.join(path)} have no 'load': apply the model with "
                   f"mutable=['router']")
  load = jnp.asarray(stats["load"], jnp.float32)
  new = dict(state)
  new["load_total"] = state["load_total"] + load
  if mode == "quantile":
    if "bias_next" not in stats:
      raise KeyError(f"router stats at {'/'.join(path)} have no 'bias_next': was the model built "
                     f"with moe.balance='quantile'?")
    new["bias"] = jnp.asarray(stats["bias_next"], jnp.float32)
  elif mode == "sign":
    new["bias"] = sign_update(state["bias"], load, cfg_moe.sign_rate)
  else:  # "aux" and "none" route with the unbiased scores
    new["bias"] = jnp.zeros_like(state["bias"])
  return new


def next_balance_state(mode: str, balance_vars, router_stats, cfg_moe):
  """The balance collection for the next step, from this step's sown router statistics.

  balance_vars: the "balance" collection (nested by module path, leaves per MoE layer:
  {"bias", "load_total"}); router_stats: the "router" collection that the same apply sowed.
  quantile: the bias computed from this batch; sign: one sign step of rate cfg_moe.sign_rate;
  aux/none: zeros. Every mode accumulates load_total. Pure and jittable.
  """
  if mode not in BALANCE_MODES:
    raise ValueError(f"balance mode {mode!r} not in {BALANCE_MODES}")

  def walk(state, stats, path):
    if not isinstance(state, Mapping):
      raise ValueError(f"balance state at {'/'.join(path)} is not a mapping: {type(state)}")
    if "bias" in state:
      return _updated_layer(mode, state, stats, cfg_moe, path)
    out = {}
    for key, sub in state.items():
      if key not in stats:
        raise KeyError(f"router stats have no entry for balance state {'/'.join((*path, key))}")
      out[key] = walk(sub, stats[key], (*path, key))
    return out

  return walk(balance_vars, router_stats, ())
