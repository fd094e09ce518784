"""Quantile balancing, the histogram quantile under data parallelism, state updates and metrics."""

import functools

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from moejax.config import base_config
from moejax.moe import balance, metrics
from moejax.parallel.mesh import make_mesh

M, N, K = 4096, 256, 8


def skewed_scores(key, popularity_N, m=M):
  """Sigmoid scores whose per-expert mean is strongly skewed by `popularity`."""
  return jax.nn.sigmoid(popularity_N + jax.random.normal(key, (m, popularity_N.shape[0])))


def batch_maxvio(scores, bias, k=K):
  """MaxVio of top-k routing, computed with numpy (independent of the library)."""
  s = np.asarray(scores, np.float64) + np.asarray(bias, np.float64)
  chosen = np.argsort(-s, axis=1)[:, :k]
  load = np.bincount(chosen.ravel(), minlength=s.shape[1])
  assert load.sum() == s.shape[0] * k  # every token has exactly k experts
  return (load.max() - load.mean()) / load.mean()


@pytest.fixture(scope="module")
def skewed():
  k_pop, k_a, k_b = jax.random.split(jax.random.key(0), 3)
  popularity = 3.0 * jax.random.normal(k_pop, (N,))
  return skewed_scores(k_a, popularity), skewed_scores(k_b, popularity)


def test_quantile_bias_balances_a_skewed_batch(skewed):
  scores, next_scores = skewed
  bias = jax.jit(balance.quantile_bias, static_argnums=(1, 3))(scores, K, None, 10)
  assert bias.shape == (N,) and bias.dtype == jnp.float32
  assert abs(float(jnp.mean(bias))) < 1e-5
  assert batch_maxvio(scores, np.zeros(N)) > 1.0
  assert batch_maxvio(scores, bias) <= 0.05
  # The bias of batch t routes batch t+1: sampling noise remains, the skew does not.
  unbiased, carried = batch_maxvio(next_scores, np.zeros(N)), batch_maxvio(next_scores, bias)
  assert carried < 0.6 and carried < unbiased / 20


def test_quantile_bias_histogram_over_data_shards(skewed):
  """Histogram bin counts psum'd over 8 data shards: as balanced as the exact quantile."""
  scores, _ = skewed
  mesh = make_mesh(data=8)
  fn = jax.shard_map(lambda s: balance.quantile_bias(s, K, None, 10, bins=2048, axis_name="data"),
                     mesh=mesh, in_specs=P("data"), out_specs=P())
  bias = jax.jit(fn)(jax.device_put(scores, jax.NamedSharding(mesh, P("data"))))
  assert abs(float(jnp.mean(bias))) < 1e-5
  assert batch_maxvio(scores, bias) <= 0.05


@functools.partial(jax.jit, static_argnums=2)
def _sharded_threshold(values, num_above, bins):
  fn = jax.shard_map(lambda v, q: balance.histogram_threshold(v, q, bins, axis_name="data"),
                     in_specs=(P("data"), P()), out_specs=P())
  return fn(jax.reshard(values, P("data")), num_above)


def sharded_threshold(values, num_above, bins):
  """histogram_threshold over 8 data shards, bin counts psum'd."""
  with jax.set_mesh(make_mesh(data=8)):
    return np.asarray(_sharded_threshold(jnp.asarray(values), jnp.float32(num_above), bins))


def check_within_one_bin(values, num_above, bins, threshold):
  v = np.asarray(values, np.float64)
  width = (v.max(0) - v.min(0)) / bins
  exact = -np.sort(-v, axis=0)[num_above - 1]  # the num_above-th largest value of each column
  assert np.all(np.abs(threshold - exact) <= width * (1 + 1e-4) + 1e-6), (threshold - exact) / width


def test_histogram_quantile_matches_exact_within_one_bin():
  values = jax.random.normal(jax.random.key(1), (4096, 16)) * jnp.linspace(0.1, 3.0, 16)
  num_above = 4096 * 8 // 256
  check_within_one_bin(values, num_above, 2048, sharded_threshold(values, num_above, 2048))
  exact = np.asarray(balance.exact_threshold(values, num_above))
  np.testing.assert_array_equal(np.sum(np.asarray(values) > exact, axis=0), num_above)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(2, 300), cols=st.integers(1, 5),
       frac=st.floats(0.0, 1.0), levels=st.sampled_from([0, 3, 50]))
def test_exact_threshold_is_the_midpoint_of_the_sorted_column(seed, rows, cols, frac, levels):
  """Radix selection against a sort: the midpoint of the q-th and (q+1)-th largest of each column,
  q clipped to [1, rows - 1], with negative and positive values, signed zeros and (levels > 0)
  many ties."""
  rng = np.random.default_rng(seed)
  v = rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-3, 4, cols)
  if levels:
    v = np.round(v * levels) / levels
  v = v.astype(np.float32)
  v[rng.random(v.shape) < 0.05] = -0.0
  num_above = frac * rows
  q = min(max(round(num_above), 1), rows - 1)
  desc = -np.sort(-v, axis=0)
  want = np.float32(0.5) * (desc[q - 1] + desc[q])
  got = np.asarray(jax.jit(balance.exact_threshold, static_argnums=1)(jnp.asarray(v), num_above))
  np.testing.assert_array_equal(got, want)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), rows_per_shard=st.sampled_from([4, 16, 64]),
       bins=st.sampled_from([16, 64, 512]), frac=st.floats(0.02, 0.9))
def test_histogram_quantile_property(seed, rows_per_shard, bins, frac):
  rng = np.random.default_rng(seed)
  values = np.concatenate([rng.standard_normal((8 * rows_per_shard, 3)),
                           rng.exponential(size=(8 * rows_per_shard, 2))], axis=1).astype(np.float32)
  num_above = max(1, int(frac * values.shape[0]))
  check_within_one_bin(values, num_above, bins, sharded_threshold(values, num_above, bins))


def test_quantile_bias_rejects_bad_input():
  with pytest.raises(ValueError, match="tokens, experts"):
    balance.quantile_bias(jnp.zeros((4,)), 1)
  with pytest.raises(ValueError, match="top-k"):
    balance.quantile_bias(jnp.zeros((4, 3)), 4)
  with pytest.raises(ValueError, match="bins"):
    balance.quantile_bias(jnp.zeros((4, 3)), 1, axis_name="data")
  with pytest.raises(ValueError, match="bias shape"):
    balance.quantile_bias(jnp.zeros((4, 3)), 1, jnp.zeros(2))
  chex.assert_trees_all_equal(balance.quantile_bias(jnp.full((4, 3), 0.5), 3), jnp.zeros(3))


def moe_cfg(**overrides):
  c = base_config().model.moe
  c.update(overrides)
  return ml_collections.FrozenConfigDict(c)


def nested(leaf):
  return {"layer_1": {"moe": leaf}, "layer_2": {"moe": leaf}}


@pytest.mark.parametrize("mode", ["quantile", "sign", "aux", "none"])
def test_next_balance_state(mode):
  load = jnp.array([4.0, 1.0, 2.0, 1.0])
  state = nested({"bias": jnp.array([0.1, 0.0, -0.2, 0.1]), "load_total": jnp.array([1.0, 2, 3, 4])})
  stats = nested({"load": load, "dropped": jnp.int32(0), "bias_next": jnp.array([-1.0, 1, 0, 0])})
  new = jax.jit(lambda b, s: balance.next_balance_state(mode, b, s, moe_cfg(sign_rate=0.01)))(state, stats)
  layer = new["layer_2"]["moe"]
  chex.assert_trees_all_close(layer["load_total"], jnp.array([5.0, 3, 5, 5]))
  expected = {"quantile": [-1.0, 1, 0, 0], "sign": [0.09, 0.01, -0.2, 0.11],
              "aux": [0.1, 0.0, -0.2, 0.1], "none": [0.1, 0.0, -0.2, 0.1]}[mode]  # aux, none: left as it is
  chex.assert_trees_all_close(layer["bias"], jnp.array(expected), atol=1e-7)


def test_smoothed_quantile_bias_averages_the_solves():
  """quantile_smoothing s: the next bias is s * the current one + (1 - s) * this batch's solve, so over
  a run it is the exponential average of the solves from the starting bias on."""
  s = 0.75
  solves = jax.random.normal(jax.random.key(0), (5, 4))
  solves = solves - solves.mean(axis=1, keepdims=True)
  state = nested({"bias": jnp.zeros(4), "load_total": jnp.zeros(4)})
  update = jax.jit(lambda b, st: balance.next_balance_state("quantile", b, st, moe_cfg(quantile_smoothing=s)))
  for solve in solves:
    state = update(state, nested({"load": jnp.ones(4), "bias_next": solve}))
  weights = (1 - s) * s ** jnp.arange(len(solves))[::-1]
  chex.assert_trees_all_close(state["layer_1"]["moe"]["bias"], weights @ solves, atol=1e-6)
  assert abs(float(jnp.mean(state["layer_1"]["moe"]["bias"]))) < 1e-6  # stays mean-zero


def test_next_balance_state_errors():
  state = nested({"bias": jnp.zeros(4), "load_total": jnp.zeros(4)})
  with pytest.raises(ValueError, match="balance mode"):
    balance.next_balance_state("bogus", state, {}, moe_cfg())
  with pytest.raises(KeyError, match="layer_1"):
    balance.next_balance_state("sign", state, {"layer_2": {"moe": {"load": jnp.zeros(4)}}}, moe_cfg())
  with pytest.raises(KeyError, match="bias_next"):
    balance.next_balance_state("quantile", state, nested({"load": jnp.zeros(4)}), moe_cfg())


def test_balance_metrics():
  stats = {"layer_1": {"moe": {"load": jnp.array([6.0, 2, 2, 2]), "dropped": jnp.int32(3),
                                "aux_loss": jnp.float32(0.5)}},
           "layer_2": {"moe": {"load": jnp.array([3.0, 3, 3, 3]), "dropped": jnp.int32(0)}}}
  state = {"layer_1": {"moe": {"bias": jnp.zeros(4), "load_total": jnp.array([2.0, 2, 2, 6])}},
           "layer_2": {"moe": {"bias": jnp.zeros(4), "load_total": jnp.array([1.0, 1, 1, 1])}}}
  out = metrics.balance_metrics(stats, state, top_k=2)
  assert all(jnp.ndim(v) == (1 if k.endswith("/load") else 0) for k, v in out.items())
  np.testing.assert_allclose(out["moe/layer_1/moe/load"], [2.0, 2 / 3, 2 / 3, 2 / 3])  # over the mean 3
  np.testing.assert_allclose(out["moe/layer_1/moe/maxvio_batch"], 1.0)  # max 6 vs mean 3
  np.testing.assert_allclose(out["moe/layer_1/moe/top_share"], 1.0)  # 6 tokens, all chose expert 0
  np.testing.assert_allclose(out["moe/layer_2/moe/top_share"], 0.5)
  np.testing.assert_allclose(out["moe/layer_1/moe/load_min"], 2 / 3)
  np.testing.assert_allclose(out["moe/layer_1/moe/maxvio_global"], 1.0)
  np.testing.assert_allclose(out["moe/maxvio_batch"], 0.5)
  np.testing.assert_allclose(out["moe/maxvio_global"], 0.5)
  np.testing.assert_allclose(out["moe/dropped"], 3)
  np.testing.assert_allclose(out["moe/aux_loss"], 0.5)
  assert set(metrics.expert_loads(stats)) == {"layer_1/moe", "layer_2/moe"}
