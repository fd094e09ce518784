"""The assembled decoder: one trace, causality and document isolation end to end, parameter counts."""

import pathlib

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import base_config, load_experiment
from moejax.layout import layer_kinds
from moejax.model import build_model, init_variables
from moejax.params import count_params

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _experiment(name):
  return load_experiment(ROOT / "experiments" / f"{name}.py")


def _small_config(**model):
  """One KDA layer with the dense FFN, one MLA layer with the MoE: every component, little compile."""
  c = base_config()
  c.data.vocab_size = 300
  c.model.num_layers = 2
  c.model.layer_pattern = "KM"
  c.model.attnres.block_size = 2
  for k, v in model.items():
    c.model[k] = v
  return c


_VARIABLES = {}


def _init(config, B=2, T=24):
  """The model and its variables, made once per config (model.init compiles the whole model) and shared
  by the tests that build the same one."""
  model = build_model(config)
  key = (config.to_json_best_effort(sort_keys=True), B, T)
  if key not in _VARIABLES:
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((B, T), jnp.int32))
    _VARIABLES[key] = {k: v for k, v in variables.items() if k in ("params", "balance")}
  return model, _VARIABLES[key]


def _apply(model, variables, tokens, segment_ids=None):
  (h, _), _ = model.apply(variables, tokens, segment_ids, mutable=["router", "attn_stats"])
  return h


def _jitted(model):
  return jax.jit(lambda variables, tokens, segment_ids: _apply(model, variables, tokens, segment_ids))


def test_layer_kinds_follow_pattern_and_dense_prefix():
  c = _small_config(num_layers=8, layer_pattern="KKKM", num_dense_layers=2)
  assert layer_kinds(c.model) == [("kda", "dense"), ("kda", "dense"), ("kda", "moe"), ("mla", "moe"),
                                  ("kda", "moe"), ("kda", "moe"), ("kda", "moe"), ("mla", "moe")]


def test_init_variables_leaves_the_config_alone():
  """init_variables runs the XLA kernels on a copy: the caller's config (and everything later built
  from it, like the step benchmark's per-component timings) keeps its kernel choices."""
  config = _small_config()
  config.model.kda.implementation, config.model.mla.attention = "interpret", "interpret"
  model = build_model(config)
  variables = init_variables(model, jax.random.key(0))
  assert set(variables) == {"params", "balance"}
  assert (config.model.kda.implementation, config.model.mla.attention, config.model.moe.grouped_matmul) == \
      ("interpret", "interpret", "auto")
  assert model.cfg.kda.implementation == "interpret"


def test_forward_traces_once_and_is_finite():
  config = _small_config()
  model, variables = _init(config)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def forward(variables, tokens, segment_ids):
    return _apply(model, variables, tokens, segment_ids)

  for seed in range(3):
    tokens = jax.random.randint(jax.random.key(seed), (2, 24), 0, 300)
    h = forward(variables, tokens, jnp.ones((2, 24), jnp.int32))
    assert h.shape == (2, 24, config.model.d_model)
    assert bool(jnp.all(jnp.isfinite(h)))


@pytest.mark.parametrize("mode", ["attnres", "residual"])
def test_causal_end_to_end(mode):
  config = _small_config()
  config.model.attnres.mode = mode
  config.model.moe.balance = "none"  # routing must not depend on other tokens' batch statistics
  model, variables = _init(config)
  forward = _jitted(model)
  tokens = jax.random.randint(jax.random.key(1), (1, 24), 0, 300)
  one_doc = jnp.ones((1, 24), jnp.int32)
  base = forward(variables, tokens, one_doc)
  changed = forward(variables, tokens.at[0, 15].set((tokens[0, 15] + 7) % 300), one_doc)
  np.testing.assert_allclose(np.asarray(base[:, :15]), np.asarray(changed[:, :15]), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(base[:, 15:]), np.asarray(changed[:, 15:]))


def test_packed_documents_equal_separate_runs():
  """No token sees another document through any layer: KDA state, short conv, MLA, AttnRes."""
  config = _small_config()
  config.model.moe.balance = "none"
  model, variables = _init(config)
  forward = _jitted(model)
  lengths = [7, 1, 11, 5]
  T = sum(lengths)
  docs = [jax.random.randint(jax.random.key(10 + i), (1, n), 0, 300) for i, n in enumerate(lengths)]
  packed = jnp.concatenate(docs, axis=1)
  segment_ids = jnp.concatenate([jnp.full((1, n), i + 1, jnp.int32) for i, n in enumerate(lengths)], 1)
  h_packed = forward(variables, packed, segment_ids)
  start = 0
  for doc, n in zip(docs, lengths, strict=True):
    # Alone: the document first in the row (one shape, one compile); by causality what follows it
    # cannot reach its outputs.
    row = jnp.concatenate([doc, jnp.zeros((1, T - n), jnp.int32)], axis=1)
    h_alone = forward(variables, row, jnp.ones((1, T), jnp.int32))[:, :n]
    np.testing.assert_allclose(np.asarray(h_packed[:, start:start + n]), np.asarray(h_alone),
                               rtol=1e-4, atol=1e-4)
    start += n


def test_gradients_reach_every_parameter():
  config = _small_config()
  model, variables = _init(config)
  tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, 300)

  def loss(params):
    h = _apply(model, {**variables, "params": params}, tokens)
    return jnp.mean(jnp.square(h @ jax.random.normal(jax.random.key(3), (h.shape[-1],))))

  # Zero-initialised AttnRes queries get a gradient too: the softmax is at its symmetric point but
  # the sources differ.
  grads = jax.jit(jax.grad(loss))(variables["params"])
  flat = jax.tree_util.tree_flatten_with_path(nn.unbox(grads))[0]
  # The LM head is not part of this loss (it reads the hidden states), so it alone gets no gradient.
  dead = [jax.tree_util.keystr(p) for p, g in flat
          if not float(jnp.max(jnp.abs(g))) > 0 and p[0].key != "head"]
  assert not dead, f"parameters with zero gradient: {dead}"


def test_remat_changes_memory_not_values():
  """model.remat ("dots", "full") recomputes in the backward pass what "none" keeps: the same loss and
  gradients (both against one compiled "none" model)."""
  tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, 300)
  probe = jax.random.normal(jax.random.key(3), (2, 24, base_config().model.d_model))

  _, variables = _init(_small_config(remat="none"))  # one init: remat leaves the parameters as they are

  def value_and_grads(config):
    model = build_model(config)
    loss = lambda params: jnp.sum(_apply(model, {**variables, "params": params}, tokens) * probe)
    return jax.jit(jax.value_and_grad(loss))(variables["params"])

  want = value_and_grads(_small_config(remat="none"))
  for remat in ("dots", "full"):
    got = value_and_grads(_small_config(remat=remat))
    chex.assert_trees_all_equal_structs(got, want)
    # The recomputation fuses differently: float32 noise, relative to each leaf's scale.
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
      g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
      assert np.max(np.abs(g - w)) <= 1e-4 * np.max(np.abs(w)), (remat, jax.tree_util.keystr(path))


def test_k3_parameter_counts_hit_reported_totals():
  counts = count_params(_experiment("k3"))
  assert abs(counts["total"] / 2.78e12 - 1) <= 0.03, counts["total"]
  assert abs(counts["active"] / 104.2e9 - 1) <= 0.03, counts["active"]


def test_gpu_kernels_in_interpret_mode_match_the_xla_model():
  """The whole model with the kernels it runs on GPU (KDA Pallas, the experts' grouped matmul, MLA's
  flash kernel), here in Pallas interpret mode, against the all-XLA model: hidden states and every
  parameter's gradient on packed rows of a length that fits none of the kernels' tiles."""
  tokens = jax.random.randint(jax.random.key(2), (2, 37), 0, 300)
  seg = jnp.asarray(np.repeat([[1, 2, 3], [4, 4, 5]], [12, 20, 5], axis=1), jnp.int32)
  probe = jax.random.normal(jax.random.key(3), (2, 37, 64))
  results = []
  _, variables = _init(_small_config())  # the same weights for both (initialised by the XLA model)
  for impl in ("xla", "interpret"):
    config = _small_config()
    config.model.kda.implementation = impl
    config.model.mla.attention = impl
    config.model.moe.grouped_matmul = impl
    model = build_model(config)

    def loss(params, model=model, variables=variables):
      return jnp.sum(_apply(model, {**variables, "params": params}, tokens, seg) * probe)

    results.append(jax.jit(jax.value_and_grad(loss))(variables["params"]))
  (loss_xla, grads_xla), (loss_interp, grads_interp) = results
  np.testing.assert_allclose(float(loss_interp), float(loss_xla), rtol=1e-5)
  # Per parameter, relative to its gradient's norm: a few embedding rows that only one or two tokens
  # touch carry small entries that elementwise tolerances would judge by their own size.
  for (path, g), ref in zip(jax.tree_util.tree_flatten_with_path(grads_interp)[0], jax.tree.leaves(grads_xla),
                            strict=True):
    err = float(jnp.linalg.norm(g - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))
    assert err < 1e-4, (jax.tree_util.keystr(path), err)


def test_tied_embeddings_head_is_the_scaled_embedding():
  """Tied: no head parameter, the logits are h E^T / sqrt(D) (the model's and the train step's head
  agree), and the initial loss is near log V as untied, not sqrt(D)-sized logits' far above it."""
  from moejax.training.loss import cross_entropy
  from moejax.training.state import head_matrix

  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 300, (2, 24)), jnp.int32)
  losses = {}
  for tied in (False, True):
    config = _small_config(tie_embeddings=tied, d_model=64)
    model, variables = _init(config)
    assert ("head" in variables["params"]) is not tied
    h = _apply(model, variables, tokens)
    params = nn.unbox(variables["params"])
    w_DV = head_matrix(params, config.model)
    if tied:
      np.testing.assert_allclose(w_DV, params["embedding"].T / 8.0, rtol=1e-6)
    logits = model.apply(variables, h, method=model.logits)
    np.testing.assert_allclose(logits, jnp.dot(h, w_DV), rtol=1e-4, atol=1e-4)
    losses[tied], _ = cross_entropy(h, w_DV, jnp.roll(tokens, -1, axis=1))
  assert abs(float(losses[True]) - np.log(300)) < 1.0 and abs(float(losses[False]) - np.log(300)) < 1.0
