"""The MoE layer against a per-token loop over the chosen experts, its sown stats and its errors."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from moejax.config import base_config, validate
from moejax.errors import ConfigError
from moejax.moe.balance import quantile_bias
from moejax.moe.layer import EXPERT_WEIGHTS, MoE
from moejax.moe.router import router_scores
from moejax.nn import GRAD_ACC
from pallas_kernels.segments import document_ids

B, T = 2, 8


def small_cfg(**moe):
  c = base_config().model
  c.d_model = 16
  c.moe.update(dict(num_experts=8, top_k=3, num_shared=2, shared_hidden_dim=12, latent_dim=8,
                    expert_hidden_dim=10, routed_scaling=2.5))
  c.moe.update(moe)
  return ml_collections.FrozenConfigDict(c)


def situ(g, u, b1=4.0, b2=25.0):
  return b1 * jnp.tanh(g / b1) * (1 / (1 + jnp.exp(-g))) * b2 * jnp.tanh(u / b2)


def chosen_experts(params, bias, x_MD, k):
  """Top-k of sigmoid(x W_r) + bias, in float64 numpy."""
  logits = np.asarray(x_MD, np.float64) @ np.asarray(params["router"], np.float64)
  s = 1 / (1 + np.exp(-logits)) + np.asarray(bias, np.float64)
  return np.argsort(-s, axis=1)[:, :k]


def reference(params, x_MD, chosen, cfg):
  """The layer for one token at a time (vmapped), with a loop over that token's chosen experts."""
  hi = jax.lax.Precision.HIGHEST
  dot = lambda a, b: jnp.dot(a, b, precision=hi)

  def one_token(x, chosen_k):
    y = sum(dot(situ(dot(x, params[f"shared_{i}"]["gate"]["kernel"]),
                     dot(x, params[f"shared_{i}"]["up"]["kernel"])), params[f"shared_{i}"]["down"]["kernel"])
            for i in range(cfg.moe.num_shared))
    s = 1 / (1 + jnp.exp(-dot(x, params["router"])))
    w = s[chosen_k] / jnp.sum(s[chosen_k]) * cfg.moe.routed_scaling
    h = dot(x, params["w_down"])
    mix = 0.0
    for j in range(chosen_k.shape[0]):
      e = chosen_k[j]
      mix = mix + w[j] * dot(situ(dot(h, params["expert_gate"][e]), dot(h, params["expert_up"][e])),
                             params["expert_down"][e])
    mix = mix / jnp.sqrt(jnp.mean(mix * mix) + cfg.norm_eps) * params["latent_norm"]
    return y + dot(mix, params["w_up"])

  return jax.vmap(one_token)(x_MD, jnp.asarray(chosen))


def normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def random_variables(model, x, seed):
  """Params with the layer's shapes, drawn with numpy: compiling the layer's init (its PRNG) on
  XLA:CPU takes far longer than the tests themselves."""
  abstract = jax.eval_shape(model.init, jax.random.key(0), x)
  rng = np.random.default_rng(seed)

  def draw(a):
    if a.ndim == 1:  # norm scales
      return jnp.asarray(1 + 0.1 * rng.standard_normal(a.shape), a.dtype)
    return jnp.asarray(rng.standard_normal(a.shape) / np.sqrt(a.shape[-2]), a.dtype)

  params = jax.tree.map(draw, nn.unbox(abstract["params"]))
  balance = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract["balance"])
  return params, balance


@pytest.fixture(scope="module")
def setup():
  cfg = small_cfg()
  model = MoE(cfg)
  x = normal(0, (B, T, cfg.d_model))
  params, balance = random_variables(model, x, 1)
  balance["bias"] = 0.3 * normal(2, (cfg.moe.num_experts,))
  return cfg, model, x, params, balance


def test_params_and_state_layout(setup):
  cfg, _, _, params, balance = setup
  e = cfg.moe
  shapes = {k: v.shape for k, v in params.items() if not k.startswith("shared")}
  assert shapes == {"router": (16, 8), "w_down": (16, 8), "expert_gate": (8, 8, 10), "expert_up": (8, 8, 10),
                    "expert_down": (8, 10, 8), "latent_norm": (8,), "w_up": (8, 16)}
  assert sorted(k for k in params if k.startswith("shared")) == [f"shared_{i}" for i in range(e.num_shared)]
  assert set(balance) == {"bias", "load_total"}


def test_router_weight_is_float32_whatever_the_param_dtype():
  cfg = base_config().model
  cfg.update(small_cfg().to_dict())
  cfg.param_dtype = "bfloat16"
  cfg = ml_collections.FrozenConfigDict(cfg)
  x = jnp.zeros((B, T, cfg.d_model), jnp.float32)
  params = nn.unbox(jax.eval_shape(MoE(cfg).init, jax.random.key(0), x)["params"])
  assert params["router"].dtype == jnp.float32
  assert {p.dtype for k, p in params.items() if k not in ("router", "latent_norm")
          and not k.startswith("shared")} == {jnp.dtype(jnp.bfloat16)}


def test_routed_scaling_is_divided_out_by_the_latent_norm(setup):
  """docs/design.md §5 scales p before the RMSNorm, which removes any common factor: the output moves only
  through the norm's eps."""
  cfg, model, x, params, balance = setup
  ys = [MoE(small_cfg(routed_scaling=r)).apply({"params": params, "balance": balance}, x)
        for r in (1.0, 2.5, 100.0)]
  for y in ys[1:]:
    assert float(jnp.max(jnp.abs(y - ys[0])) / jnp.max(jnp.abs(ys[0]))) < 1e-3


@pytest.mark.parametrize("grouped_matmul", ["xla", "interpret"])
def test_matches_per_token_loop_with_gradients(setup, grouped_matmul):
  """Both grouped matmuls: jax.lax.ragged_dot and the Pallas kernels (interpret mode) used on GPU."""
  cfg, _, x, params, balance = setup
  model = MoE(small_cfg(grouped_matmul=grouped_matmul))
  x_MD = x.reshape(B * T, -1)
  chosen = chosen_experts(params, balance["bias"], x_MD, cfg.moe.top_k)
  cot = normal(3, x.shape)

  def layer_loss(p, x):
    return jnp.sum(model.apply({"params": p, "balance": balance}, x) * cot)

  def ref_loss(p, x):
    return jnp.sum(reference(p, x.reshape(B * T, -1), chosen, cfg).reshape(x.shape) * cot)

  y = jax.jit(model.apply)({"params": params, "balance": balance}, x)
  y_ref = jax.jit(lambda p, x: reference(p, x, chosen, cfg))(params, x_MD)
  chex.assert_trees_all_close(y, y_ref.reshape(x.shape), atol=1e-5, rtol=1e-5)
  grads = jax.jit(jax.grad(layer_loss, argnums=(0, 1)))(params, x)
  ref_grads = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(params, x)
  chex.assert_trees_all_close(grads, ref_grads, atol=1e-5, rtol=1e-4)
  assert float(jnp.abs(grads[0]["router"]).max()) > 0  # the router learns through the weights


@pytest.mark.parametrize("grouped_matmul, token_chunk", [("xla", 0), ("interpret", 0), ("xla", 8)])
def test_gradient_accumulators_come_back_added(setup, grouped_matmul, token_chunk):
  """With the experts' accumulators in the GRAD_ACC collection the output is unchanged and each expert
  weight's gradient is accumulator + its gradient without them, added once: in the drhs kernels, or
  with token chunks (two here) once over the chunks' summed cotangents; the other gradients are
  untouched."""
  cfg, _, x, params, balance = setup
  model = MoE(small_cfg(grouped_matmul=grouped_matmul, token_chunk=token_chunk))
  cot = normal(3, x.shape)
  accs = {name: normal(10 + i, params[name].shape) for i, name in enumerate(EXPERT_WEIGHTS)}

  def loss(p, extra):
    return jnp.sum(model.apply({"params": p, "balance": balance, **extra}, x) * cot)

  plain = jax.jit(jax.value_and_grad(loss))(params, {})
  added = jax.jit(jax.value_and_grad(loss))(params, {GRAD_ACC: accs})
  np.testing.assert_allclose(added[0], plain[0], rtol=1e-6)
  want = {**plain[1], **{name: plain[1][name] + accs[name] for name in EXPERT_WEIGHTS}}
  chex.assert_trees_all_close(added[1], want, atol=1e-5, rtol=1e-5)


def test_gradient_accumulators_must_match_the_experts(setup):
  cfg, model, x, params, balance = setup
  variables = {"params": params, "balance": balance}
  accs = {name: jnp.zeros_like(params[name]) for name in EXPERT_WEIGHTS}
  with pytest.raises(ValueError, match="exactly"):
    model.apply({**variables, GRAD_ACC: {"expert_gate": accs["expert_gate"]}}, x)
  with pytest.raises(ValueError, match="must be float32"):
    model.apply({**variables, GRAD_ACC: {**accs, "expert_up": accs["expert_up"][:, :2]}}, x)
  with pytest.raises(ValueError, match="must be float32"):
    model.apply({**variables, GRAD_ACC: {**accs, "expert_up": accs["expert_up"].astype(jnp.bfloat16)}}, x)


def test_sown_stats_and_bias_has_no_gradient(setup):
  cfg, model, x, params, balance = setup
  apply = jax.jit(model.apply, static_argnames="mutable")
  y_sown, stats = apply({"params": params, "balance": balance}, x, mutable=("router",))
  stats = stats["router"]
  chosen = chosen_experts(params, balance["bias"], x.reshape(B * T, -1), cfg.moe.top_k)
  assert all(len(set(row)) == cfg.moe.top_k for row in chosen.tolist())
  np.testing.assert_array_equal(stats["load"], np.bincount(chosen.ravel(), minlength=cfg.moe.num_experts))
  assert float(stats["load"].sum()) == B * T * cfg.moe.top_k
  assert int(stats["dropped"]) == 0
  assert stats["bias_next"].shape == (cfg.moe.num_experts,)
  assert abs(float(stats["bias_next"].mean())) < 1e-6
  # The layer hands quantile_bias the unbiased scores, its k, the current bias and its sweep count.
  s_ME = router_scores(x.reshape(B * T, -1), params["router"], cfg.moe.router_matmul)
  want = quantile_bias(s_ME, cfg.moe.top_k, balance["bias"], cfg.moe.balance_iters)
  bits = lambda a: np.asarray(a).view(np.uint32)
  np.testing.assert_array_equal(bits(stats["bias_next"]), bits(want))

  grad_bias = jax.jit(jax.grad(lambda b: jnp.sum(model.apply({"params": params, "balance": b}, x))))(balance)
  chex.assert_trees_all_equal(grad_bias, jax.tree.map(jnp.zeros_like, balance))
  # Without a mutable "router" collection nothing is sown and the quantile work is skipped.
  chex.assert_trees_all_close(apply({"params": params, "balance": balance}, x), y_sown)


def test_quantile_oracle_routes_the_batch_with_its_own_bias(setup):
  """model.moe.quantile_oracle: a training apply routes with the bias solved on its own batch (from the
  carried one) and sows that bias as the next; an apply without router stats routes with the carried
  bias, as the causal layer does."""
  cfg, _, x, params, balance = setup
  model = MoE(small_cfg(quantile_oracle=True))
  apply = jax.jit(model.apply, static_argnames="mutable")
  _, stats = apply({"params": params, "balance": balance}, x, mutable=("router",))
  stats = stats["router"]
  s_ME = router_scores(x.reshape(B * T, -1), params["router"], cfg.moe.router_matmul)
  own = quantile_bias(s_ME, cfg.moe.top_k, balance["bias"], cfg.moe.balance_iters)
  bits = lambda a: np.asarray(a).view(np.uint32)
  np.testing.assert_array_equal(bits(stats["bias_next"]), bits(own))
  chosen = chosen_experts(params, own, x.reshape(B * T, -1), cfg.moe.top_k)
  np.testing.assert_array_equal(stats["load"], np.bincount(chosen.ravel(), minlength=cfg.moe.num_experts))
  causal = np.bincount(chosen_experts(params, balance["bias"], x.reshape(B * T, -1), cfg.moe.top_k).ravel(),
                       minlength=cfg.moe.num_experts)
  assert np.ptp(stats["load"]) < np.ptp(causal), (stats["load"], causal)  # this batch, balanced by its bias
  chex.assert_trees_all_close(apply({"params": params, "balance": balance}, x),
                              jax.jit(MoE(cfg).apply)({"params": params, "balance": balance}, x))
  with pytest.raises(ConfigError, match="quantile_oracle.*needs balance='quantile'"):
    c = base_config()
    c.model.moe.update(balance="sign", quantile_oracle=True)
    validate(c)


def test_replayed_experts_route_and_the_router_keeps_its_gradient(setup):
  """A REPLAY collection forces each token's experts (moejax/moe/replay.py): the output is the per-token
  loop's over those experts, a token of -1s chooses its own, the sown ROUTING holds what was taken, and
  the router still gets a gradient (through the weights of the replayed experts)."""
  cfg, model, x, params, balance = setup
  M, k, n = B * T, cfg.moe.top_k, cfg.moe.num_experts
  rng = np.random.default_rng(3)
  forced = np.stack([rng.choice(n, k, replace=False) for _ in range(M)]).astype(np.int32)
  forced[::3] = -1  # every third token routes itself
  own = chosen_experts(params, balance["bias"], x.reshape(M, -1), k)
  taken = np.where(forced[:, :1] >= 0, forced, own)
  replayed = {"experts": jnp.asarray(forced.reshape(B, T, k))}
  variables = {"params": params, "balance": balance, "replay": replayed}
  y, sown = jax.jit(model.apply, static_argnames="mutable")(variables, x, mutable=("routing", "router"))
  np.testing.assert_array_equal(np.asarray(sown["routing"]["experts"]).reshape(M, k), taken)
  np.testing.assert_array_equal(sown["router"]["load"], np.bincount(taken.ravel(), minlength=n))
  want = reference(params, x.reshape(M, -1), taken, cfg).reshape(y.shape)
  chex.assert_trees_all_close(y, want, atol=2e-5, rtol=2e-5)

  def router_grad(vs):
    return jax.grad(lambda p: jnp.sum(model.apply({**vs, "params": p}, x) ** 2))(params)["router"]

  g = jax.jit(router_grad)(variables)
  g_ref = jax.grad(lambda r: jnp.sum(reference({**params, "router": r}, x.reshape(M, -1), taken, cfg) ** 2))(
      params["router"])
  chex.assert_trees_all_close(g, g_ref, atol=1e-4, rtol=1e-4)
  assert float(jnp.abs(g).max()) > 0
  with pytest.raises(ValueError, match="replayed experts"):
    model.apply({**variables, "replay": {"experts": jnp.zeros((B, T, k + 1), jnp.int32)}}, x)


def test_balance_implementation_reaches_the_quantile_bias(setup):
  """model.moe.balance_implementation picks quantile_bias's implementation: the kernels (interpret
  mode) sow the same bits as XLA; a name the config check would refuse fails at the call."""
  _, _, x, params, balance = setup
  sown = {}
  for impl in ("xla", "interpret"):
    model = MoE(small_cfg(balance_implementation=impl))
    _, stats = jax.jit(model.apply, static_argnames="mutable")({"params": params, "balance": balance}, x,
                                                              mutable=("router",))
    sown[impl] = np.asarray(stats["router"]["bias_next"])
  np.testing.assert_array_equal(sown["interpret"].view(np.uint32), sown["xla"].view(np.uint32))
  with pytest.raises(ValueError, match="unknown quantile balance implementation 'cuda'"):
    MoE(small_cfg(balance_implementation="cuda")).apply({"params": params, "balance": balance}, x,
                                                        mutable=("router",))


def aux_reference(s_MN, chosen, seg_BT, k):
  """DeepSeek-V3 sequence-wise loss, averaged over documents, by explicit loops in numpy."""
  n = s_MN.shape[1]
  s = np.asarray(s_MN, np.float64).reshape(*seg_BT.shape, n)
  c = chosen.reshape(*seg_BT.shape, k)
  losses = []
  for b in range(seg_BT.shape[0]):
    starts = [0] + [t for t in range(1, seg_BT.shape[1]) if seg_BT[b, t] != seg_BT[b, t - 1]]
    for lo, hi in zip(starts, starts[1:] + [seg_BT.shape[1]], strict=True):
      f = np.bincount(c[b, lo:hi].ravel(), minlength=n) * n / (k * (hi - lo))
      p = (s[b, lo:hi] / s[b, lo:hi].sum(-1, keepdims=True)).mean(0)
      losses.append(np.sum(f * p))
  return np.mean(losses)


def test_sequence_aux_loss():
  cfg = small_cfg(balance="aux", aux_loss_weight=0.01)
  model = MoE(cfg)
  x = normal(4, (B, T, cfg.d_model))
  seg = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5]], jnp.int32)
  np.testing.assert_array_equal(document_ids(seg), [[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8])
  params, balance = random_variables(model, x, 5)
  _, stats = jax.jit(model.apply, static_argnames="mutable")(
      {"params": params, "balance": balance}, x, seg, mutable=("router",))
  x_MD = x.reshape(B * T, -1)
  s = jax.nn.sigmoid(x_MD @ params["router"])
  chosen = chosen_experts(params, balance["bias"], x_MD, cfg.moe.top_k)
  expected = 0.01 * aux_reference(s, chosen, np.asarray(seg), cfg.moe.top_k)
  np.testing.assert_allclose(stats["router"]["aux_loss"], expected, rtol=1e-5)
  assert "bias_next" not in stats["router"]

  def aux(p):
    _, stats = model.apply({"params": p, "balance": balance}, x, seg, mutable=("router",))
    return stats["router"]["aux_loss"]

  g = jax.jit(jax.grad(aux))(params)
  assert float(jnp.abs(g["router"]).max()) > 0
  assert float(jnp.abs(g["w_up"]).max()) == 0


def _bf16_layer(router_matmul):
  """Output and router gradient of a bf16 MoE layer with this router matmul (fixed draw)."""
  c = base_config().model
  c.dtype = "bfloat16"
  c.moe.router_matmul = router_matmul
  cfg = ml_collections.FrozenConfigDict(c)
  model = MoE(cfg)
  x = normal(6, (B, T, cfg.d_model))
  params, balance = random_variables(model, x, 7)
  apply = lambda p: model.apply({"params": p, "balance": balance}, x, mutable=("router",))
  y, stats = jax.jit(apply)(params)
  assert y.dtype == jnp.bfloat16 and y.shape == x.shape
  assert stats["router"]["load"].dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
  loss = lambda p: jnp.sum(apply(p)[0].astype(jnp.float32) ** 2)
  return y, jax.jit(jax.grad(loss))(params)["router"]


def test_bfloat16_compute():
  """A bf16 layer with either router matmul: the same output and router gradient, up to float32
  rounding of the logits carried through the bf16 layer (this draw's top-k has no near-ties)."""
  (y32, g32), (y3, g3) = _bf16_layer("f32"), _bf16_layer("bf16x3")
  np.testing.assert_allclose(np.asarray(y3, np.float32), np.asarray(y32, np.float32), rtol=2.0**-7, atol=1e-3)
  assert float(jnp.linalg.norm(g3 - g32) / jnp.linalg.norm(g32)) < 1e-5


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_bfloat16_grouped_experts_match_float32(impl):
  """The routed experts in bfloat16 (the grouped matmuls accumulate in float32 and write bfloat16)
  against the same experts in float32 on the same bf16-representable inputs, fixed routing,
  forward and gradients."""
  rng = np.random.default_rng(9)
  G, R, L, F = 4, 40, 16, 24
  bf = lambda shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)
  x, cot = bf((R, L)), bf((R, L))
  weights = (bf((G, L, F), L ** -0.5), bf((G, L, F), L ** -0.5), bf((G, F, L), F ** -0.5))
  sizes = jnp.asarray([12, 0, 20, 6], jnp.int32)  # an empty group, and 2 rows past the groups

  def loss(x, *w):
    y = dropless_grouped(x, sizes, *w, impl=impl)
    return jnp.sum(y.astype(jnp.float32) * cot.astype(jnp.float32)), y

  f32 = lambda t: t.astype(jnp.float32)
  (l16, y16), g16 = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, *weights)
  (l32, y32), g32 = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
      f32(x), *map(f32, weights))
  assert y16.dtype == jnp.bfloat16 and y32.dtype == jnp.float32
  rel = lambda a, b: float(jnp.linalg.norm(f32(a) - b) / jnp.linalg.norm(b))
  # The loss is a sum with cancellation: measured against its Cauchy-Schwarz scale ||y|| ||cot||.
  scale = float(jnp.linalg.norm(y32) * jnp.linalg.norm(f32(cot)))
  assert rel(y16, y32) < 1e-2 and abs(float(l16) - float(l32)) < 1e-2 * scale
  assert float(jnp.max(jnp.abs(f32(y16[38:])))) == 0  # rows past the groups stay zero
  for a, b, name in zip(g16, g32, ("x", "w_gate", "w_up", "w_down"), strict=True):
    assert rel(a, b) < 1e-2, (name, rel(a, b))


def dropless_grouped(x, sizes, w_gate, w_up, w_down, impl):
  from moejax.moe.dispatch import grouped_situ_glu
  return grouped_situ_glu(x, sizes, w_gate, w_up, w_down, 4.0, 25.0, impl)


def test_rejects_bad_input(setup):
  cfg, model, x, params, balance = setup
  variables = {"params": params, "balance": balance}
  with pytest.raises(ValueError, match="d_model"):
    model.apply(variables, x[..., :-1])
  with pytest.raises(ValueError, match="float"):
    model.apply(variables, x.astype(jnp.int32))
  with pytest.raises(ValueError, match="segment_ids"):
    model.apply(variables, x, jnp.zeros((B, T + 1), jnp.int32))
  with pytest.raises(ValueError, match="routing state"):
    model.apply({"params": params}, x)


@pytest.mark.parametrize("m, k, seed", [(7, 3, 0), (16, 8, 1), (1, 1, 2)])
def test_permutation_gathers_have_gather_backward_equal_to_autodiff(m, k, seed):
  """gather_pairs and permute_rows (custom VJPs through the inverse permutation) against autodiff of
  plain indexing, whose backward is a scatter-add."""
  from moejax.moe.dispatch import gather_pairs, inverse_permutation, permute_rows, sort_by_expert

  rng = np.random.default_rng(seed)
  idx = jnp.asarray(rng.integers(0, 5, (m, k)), jnp.int32)
  order, inverse, _ = sort_by_expert(idx, 5)
  np.testing.assert_array_equal(inverse, inverse_permutation(order))
  np.testing.assert_array_equal(np.asarray(order)[np.asarray(inverse)], np.arange(m * k))
  x = jnp.asarray(rng.normal(size=(m, 6)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(m * k, 6)), jnp.float32)
  cot = jnp.asarray(rng.normal(size=(m * k, 6)), jnp.float32)

  ours = lambda x, y: jnp.sum(cot * (gather_pairs(x, order, inverse, k)
                                    + permute_rows(y, inverse, order)) ** 2)
  plain = lambda x, y: jnp.sum(cot * (x[order // k] + y[inverse]) ** 2)
  chex.assert_trees_all_close(ours(x, y), plain(x, y), rtol=1e-6)
  chex.assert_trees_all_close(jax.grad(ours, (0, 1))(x, y), jax.grad(plain, (0, 1))(x, y),
                              rtol=1e-5, atol=1e-6)
  # Under jit, in bf16: each token's gradient sums its k rows.
  summed = lambda x: jnp.sum(gather_pairs(x, order, inverse, k).astype(jnp.float32))
  g = jax.jit(jax.grad(summed))(x.astype(jnp.bfloat16))
  assert g.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(g, np.float32), np.full((m, 6), k, np.float32))
