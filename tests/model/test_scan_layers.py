"""Scanned layers (model.scan_layers) against the unrolled stack: the same function of the same weights.

The unrolled model is the reference: its params, restacked by `stacked_layers`, must give the scanned
model the same outputs, sown stats and gradients, and one train step (Muon, QK-clip, quantile
balancing) the same loss, metrics and new params.
"""

import pathlib

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import base_config, load_experiment, validate
from moejax.errors import ConfigError
from moejax.layout import LayerLayout, layer_layout
from moejax.model import build_model, init_variables, per_layer, stacked_layers
from moejax.training.state import TrainState, init_state
from moejax.training.step import make_train_step

ROOT = pathlib.Path(__file__).resolve().parents[2]
B, T = 2, 40  # T not a multiple of the KDA chunk (16 here)


def _config(scan, *, num_layers, pattern, dense, block=4, mode="attnres", remat="none"):
  c = base_config()
  c.data.vocab_size = 300
  m = c.model
  m.update(num_layers=num_layers, layer_pattern=pattern, num_dense_layers=dense, remat=remat,
           scan_layers=scan, d_model=32)
  m.kda.update(num_heads=2, head_k_dim=16, head_v_dim=16, gate_rank=8, chunk_size=16)
  m.mla.update(num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16)
  m.attnres.update(mode=mode, block_size=block)
  m.ffn.hidden_dim = 48
  m.moe.update(num_experts=4, top_k=2, shared_hidden_dim=32, latent_dim=16, expert_hidden_dim=16)
  # A low tau, so QK-clip acts. Newton-Schulz in float32: in bf16 its rounding would swamp the float
  # noise between the scanned and unrolled gradients that the step comparison below tolerates.
  c.optim.update(name="muon", qk_clip_tau=0.5, warmup_steps=0, muon_ns_dtype="float32")
  c.train.stages = ((T, 10, B * T),)
  return validate(c)


# (name, settings, expected layout): an unrolled prefix and two periods; two periods between an unrolled
# prefix and suffix, with rematerialised layers (layer 0 stays out: its mixer has no AttnRes query);
# the first again with the matmul-saving remat policy; plain residuals from layer 0.
CASES = [
    ("attnres", dict(num_layers=6, pattern="KM", dense=1, block=4), LayerLayout(2, 2, 2)),
    ("suffix", dict(num_layers=7, pattern="K", dense=0, block=4, remat="full"), LayerLayout(2, 2, 2)),
    ("dots", dict(num_layers=6, pattern="KM", dense=1, block=4, remat="dots"), LayerLayout(2, 2, 2)),
    ("residual", dict(num_layers=4, pattern="KM", dense=0, mode="residual"), LayerLayout(0, 2, 2)),
]


def _assert_close(actual, expected, tol):
  """Leaf by leaf, max |actual - expected| <= tol * max |expected|: the two run the same float32 math
  in a different order (XLA fuses a scan body apart from its neighbours), and the summation-order noise
  scales with each leaf's magnitude, while a wrong layer, weight or mask is off by O(1)."""
  chex.assert_trees_all_equal_structs(actual, expected)

  def check(path, a, e):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    assert a.shape == e.shape, (jax.tree_util.keystr(path), a.shape, e.shape)
    err, scale = np.max(np.abs(a - e), initial=0.0), np.max(np.abs(e), initial=0.0)
    assert err <= tol * max(scale, 1e-6), f"{jax.tree_util.keystr(path)}: max err {err:.3g}, max {scale:.3g}"

  jax.tree_util.tree_map_with_path(check, actual, expected)


def _inputs():
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 300, (B, T)), jnp.int32)
  segments = jnp.asarray(np.repeat([[1] * 13 + [2] * 20 + [3] * 7], B, axis=0), jnp.int32)
  return tokens, segments


def _unrolled_and_scanned(settings):
  ref_cfg, scan_cfg = _config(False, **settings), _config(True, **settings)
  ref_model, scan_model = build_model(ref_cfg), build_model(scan_cfg)
  # init_variables returns only params and balance, so XLA drops the init's forward pass (the
  # full init would compile it like a third model); the params' shapes do not depend on the tokens'.
  variables = init_variables(ref_model, jax.random.key(1))
  ref_vars = {k: nn.unbox(variables[k]) for k in ("params", "balance")}
  # Non-zero AttnRes queries and router biases, so every mixture and routing decision is exercised.
  rng = np.random.default_rng(2)
  perturb = lambda path, x: (x + 0.3 * rng.standard_normal(x.shape).astype(x.dtype)
                             if any(getattr(k, "key", "") in ("query", "bias") for k in path) else x)
  ref_vars = jax.tree_util.tree_map_with_path(perturb, ref_vars)
  scan_vars = {k: stacked_layers(v, scan_cfg.model) for k, v in ref_vars.items()}
  return ref_cfg, scan_cfg, ref_model, scan_model, ref_vars, scan_vars


@pytest.mark.parametrize("name,settings,layout", CASES, ids=[c[0] for c in CASES])
def test_layout(name, settings, layout):
  del name
  assert layer_layout(_config(True, **settings).model) == layout
  assert layer_layout(_config(False, **settings).model).repeats == 0


def test_nothing_to_scan_is_a_config_error():
  with pytest.raises(ConfigError, match="scan_layers"):  # 8-sublayer blocks: periods of 4 from layer 4
    _config(True, num_layers=4, pattern="KM", dense=0, block=8)
  with pytest.raises(ConfigError, match="scan_layers"):  # one period of 4 fits, but it does not repeat
    _config(True, num_layers=10, pattern="KM", dense=0, block=8)


@pytest.mark.parametrize("settings,layout", [
    # A single pass over many layers would cover more of them, but saves nothing: the repeats win.
    (dict(num_layers=16, pattern="KKKM", dense=1, block=4), LayerLayout(2, 4, 3)),
    (dict(num_layers=16, pattern="KKKM", dense=1, block=4, mode="residual"), LayerLayout(1, 4, 3)),
    (dict(num_layers=8, pattern="KM", dense=0, block=2), LayerLayout(1, 2, 3)),
])
def test_layout_prefers_repeats(settings, layout):
  assert layer_layout(_config(True, **settings).model) == layout


def test_layout_finds_the_repeats_inside_a_long_pattern():
  """k3's pattern is one M then KKKM x 23 over 93 layers, with 12-layer blocks: 6 periods of 12
  layers from layer 12 (layers 0-11 and 84-92 unrolled)."""
  c = load_experiment(ROOT / "experiments" / "k3.py").model
  c.scan_layers = True
  assert layer_layout(c) == LayerLayout(12, 12, 6)


# "dots" differs from "attnres" only in what the backward saves, which test_model.py's remat test covers;
# each case here compiles two models' forward and backward, among the suite's costliest tests.
NUMERIC_CASES = [c for c in CASES if c[0] != "dots"]


@pytest.mark.parametrize("name,settings,layout", NUMERIC_CASES, ids=[c[0] for c in NUMERIC_CASES])
def test_scanned_equals_unrolled_forward_and_gradients(name, settings, layout):
  del name, layout
  ref_cfg, scan_cfg, ref_model, scan_model, ref_vars, scan_vars = _unrolled_and_scanned(settings)
  tokens, segments = _inputs()

  # The scanned model's own init has the structure and shapes that the restacking gives.
  own = jax.eval_shape(scan_model.init, jax.random.key(0), tokens)
  chex.assert_trees_all_equal_shapes_and_dtypes(nn.unbox(own["params"]), scan_vars["params"])
  chex.assert_trees_all_equal_shapes_and_dtypes(own["balance"], scan_vars["balance"])

  cotangent = jax.random.normal(jax.random.key(3), (B, T, ref_cfg.model.d_model))

  def run(model, variables):
    def loss(params):
      (h, _), stats = model.apply({"params": params, "balance": variables["balance"]}, tokens, segments,
                             mutable=["router", "attn_stats"])
      return jnp.sum(h * cotangent), (h, stats)
    (_, (h, stats)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables["params"])
    return h, stats, grads

  # per_layer inverts the restacking.
  chex.assert_trees_all_equal(per_layer(scan_vars["params"], scan_cfg.model), ref_vars["params"])
  chex.assert_trees_all_equal(stacked_layers(ref_vars["balance"], scan_cfg.model), scan_vars["balance"])

  h_ref, stats_ref, g_ref = run(ref_model, ref_vars)
  h_scan, stats_scan, g_scan = run(scan_model, scan_vars)
  _assert_close(h_scan, h_ref, 1e-4)
  _assert_close(per_layer(stats_scan["router"], scan_cfg.model), stats_ref["router"], 1e-4)
  # Gradients get 3e-4: a KDA layer's dt_bias gradient sums over every position with much cancellation,
  # so float32 fusion order alone moves it. Unrolled, the "dots" case's remat=dots and remat=none
  # gradients of that leaf differ by 6e-5 of its max; scanned against unrolled, by 1.2e-4 (with the
  # optimization barrier after KDA's short convolution, which changes how XLA fuses it).
  _assert_close(per_layer(g_scan, scan_cfg.model), g_ref, 3e-4)
  assert np.all(np.isfinite(np.asarray(h_ref)))


def test_train_step_scanned_equals_unrolled():
  """Muon orthogonalises each stacked matrix on its own, QK-clip scales each layer's heads by that
  layer's max logit, and the balance update and metrics are per layer: the step matches."""
  settings = dict(num_layers=3, pattern="M", dense=1, block=2)  # layers 1-2 scanned: MLA + MoE
  ref_cfg, scan_cfg, ref_model, scan_model, ref_vars, scan_vars = _unrolled_and_scanned(settings)
  assert layer_layout(scan_cfg.model) == LayerLayout(1, 1, 2)
  tokens, segments = _inputs()
  batch = {"tokens": tokens, "targets": jnp.roll(tokens, -1, axis=1), "segment_ids": segments,
           "loss_mask": jnp.ones((B, T), jnp.float32)}
  out = {}
  for key, cfg, model, variables in (("ref", ref_cfg, ref_model, ref_vars),
                                     ("scan", scan_cfg, scan_model, scan_vars)):
    # init_state's optimizer, by tracing it alone: its state takes these params, so compiling and
    # running the model's init there would be wasted.
    made = []
    jax.eval_shape(lambda rng, model=model, cfg=cfg, made=made: made.append(init_state(model, cfg, rng, 10)),
                   jax.random.key(0))
    optimizer = made[0][1]
    state = TrainState(step=jnp.zeros((), jnp.int32), params=variables["params"],
                       opt_state=jax.jit(optimizer.init)(variables["params"]), balance=variables["balance"],
                       rng=jax.random.key_data(jax.random.key(0)), bad_steps=jnp.zeros((), jnp.int32))
    out[key] = jax.jit(make_train_step(model, optimizer, cfg, 10))(state, batch)
  (ref_state, ref_metrics), (scan_state, scan_metrics) = out["ref"], out["scan"]
  assert set(scan_metrics) == set(ref_metrics)
  assert any(k.startswith("moe/layer_2/") for k in scan_metrics)  # named by absolute layer
  _assert_close(scan_metrics, ref_metrics, 1e-4)
  _assert_close(per_layer(scan_state.balance, scan_cfg.model), ref_state.balance, 1e-4)

  # The updates: Adam's first step is about lr * sign(grad), so an element whose gradient is float
  # noise may flip; compare on average. Orthogonalising the stacked layers as one matrix, or clipping
  # with another layer's logit, is off everywhere.
  def update_error(path, new_scan, new_ref, old):
    d_scan, d_ref = np.asarray(new_scan) - np.asarray(old), np.asarray(new_ref) - np.asarray(old)
    err, size = np.mean(np.abs(d_scan - d_ref)), np.mean(np.abs(d_ref))
    where = jax.tree_util.keystr(path)
    assert err <= 1e-2 * size + 1e-9, f"{where}: mean err {err:.3g}, mean step {size:.3g}"

  jax.tree_util.tree_map_with_path(update_error, per_layer(scan_state.params, scan_cfg.model),
                                   ref_state.params, ref_vars["params"])
  # QK-clip acted (tau is low): the MLA query up-projections shrank.
  before = ref_vars["params"]["layer_2"]["mla"]["w_uq"]
  after = per_layer(scan_state.params, scan_cfg.model)["layer_2"]["mla"]["w_uq"]
  assert float(jnp.linalg.norm(after)) < 0.99 * float(jnp.linalg.norm(before))
