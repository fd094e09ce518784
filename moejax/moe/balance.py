"""Expert load balancing as routing state (docs/design.md §5): quantile bias, sign bias, and their updates.

The state of every MoE layer lives in the Flax collection "balance", next to the params:

  bias        [n] float32  added to the router scores for top-k selection only (no gradient);
  load_total  [n] float32  tokens routed to each expert, summed over every step so far, for
                           MaxVio_global (`moejax.moe.metrics`).

Each call of the layer sows per-batch statistics into the collection "router" (`moejax.moe.layer`):
`load` [n], `dropped` (expert-parallel capacity overflow), `bias_next` [n] for "quantile" and the
weighted `aux_loss` for "aux". After each forward pass of a train step (one, or one per pass of
train.microbatch_tokens), `next_balance_state` folds them into the state. The bias computed from
batch t is only used from batch t+1 on, so routing stays causal.

Quantile balancing, with target load q = m*k/n per expert:
  c_ij = s_ij - t_ij, where t_ij is the k-th largest biased score among the *other* experts of token i,
         so expert j is chosen by token i exactly when c_ij > -b_j (given the other biases);
  b_j  = -(the value that q of the margins c_:j exceed), then b <- b - mean(b); repeat.
t_ij is the (k+1)-th largest biased score for the experts token i chooses and the k-th largest for
the rest. docs/design.md §5 uses the (k+1)-th for all of them; that overstates the margin of unchosen experts
and converges far slower: on strongly skewed batches (m=4096, n=256, k=8) this form reaches
MaxVio <= 0.05 from zero bias in 5-10 sweeps, where that one is still at 0.1-0.4 after 16. From the
previous batch's bias (the warm start used in training) a few sweeps suffice.

Under data parallelism the per-column quantile comes from histograms whose bin counts are summed over
the token axes (`histogram_threshold` with `axis_name`), so no shard sees another's scores.

The exact path's sweeps run pallas_kernels.quantile (margins and per-column threshold: Pallas kernels on
GPU, bit for bit equal to their XLA reference, which runs elsewhere); the histogram path is XLA.
"""

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from pallas_kernels.quantile import margin_threshold, resolve_implementation

# The exact path's XLA pieces live beside their kernels; they stay importable from here.
from pallas_kernels.quantile.reference import (  # noqa: F401
    RADIX_BITS,
    choice_margins,
    exact_threshold,
    kth_largest_key,
)

BALANCE_MODES = ("quantile", "sign", "aux", "none")


def _check_scores(scores_MN, k):
  if scores_MN.ndim != 2:
    raise ValueError(f"scores must be [tokens, experts], got shape {scores_MN.shape}")
  n = scores_MN.shape[1]
  if not 1 <= k <= n:
    raise ValueError(f"top-k k={k} must be in [1, num_experts={n}]")


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
                  axis_name=None, implementation: str | None = None):
  """Mean-zero bias b [n] so that top-k of (scores + b) gives every expert about m*k/n tokens.

  scores [m, n] in (0, 1) (the router's sigmoid; no gradient flows through). `bias` warm-starts the
  alternation (the previous batch's bias is a good start). `bins=None` uses the exact quantile;
  `bins=B` the histogram, which is what runs under data parallelism, with the token axes as
  `axis_name` (inside shard_map; then m counts the tokens of all shards).
  `implementation` runs each exact sweep (pallas_kernels.quantile.margin_threshold): None -> the Pallas
  kernels on GPU and XLA elsewhere, or "xla", "pallas", "interpret"; all give the same bits. The
  histogram path always runs in XLA.
  """
  _check_scores(scores, k)
  implementation = resolve_implementation(implementation)
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
    if bins is None:
      t_N = margin_threshold(s_MN, b_N, k, num_above, implementation=implementation)
    else:
      t_N = histogram_threshold(choice_margins(s_MN, b_N, k), num_above, bins, axis_name)
    # The barriers fence the re-centring off from the sweeps around it, so XLA compiles it alike
    # whichever implementation made t: fused with the XLA sweep, its mean came out an ulp off the
    # kernels' (another reduction order), and the biases drifted apart over the sweeps.
    b_N = -jax.lax.optimization_barrier(t_N)
    b_N = jax.lax.optimization_barrier(b_N - jnp.mean(b_N))
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
    solved = jnp.asarray(stats["bias_next"], jnp.float32)
    smoothing = cfg_moe.quantile_smoothing
    new["bias"] = solved if not smoothing else smoothing * state["bias"] + (1.0 - smoothing) * solved
  elif mode == "sign":
    new["bias"] = sign_update(state["bias"], load, cfg_moe.sign_rate)
  else:  # "aux" and "none" never move the bias: 0, unless moe.initial_bias skews the start for good
    new["bias"] = state["bias"]
  return new


def next_balance_state(mode: str, balance_vars, router_stats, cfg_moe):
  """The balance collection for the next step, from this step's sown router statistics.

  balance_vars: the "balance" collection (nested by module path, leaves per MoE layer:
  {"bias", "load_total"}); router_stats: the "router" collection that the same apply sowed.
  quantile: the bias computed from this batch (averaged with the current one by
  cfg_moe.quantile_smoothing); sign: one sign step of rate cfg_moe.sign_rate;
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
