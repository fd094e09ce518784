"""Optimisers: which parameters Muon takes and how, weight-decay masks, the schedule, and QK-clip.

The Muon/AdamW split and the decay mask are checked on the real model's parameters; QK-clip against
a float64 NumPy evaluation of a GatedMLA layer's per-head max logits.
"""

import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import traverse_util
from optax.contrib import MuonDimensionNumbers

from moejax.config import base_config, validate
from moejax.layers.mla import GatedMLA, max_logits
from moejax.model import build_model
from moejax.training import optimizers as optim_lib
from moejax.training.optimizers import (
  clip_by_global_norm,
  global_norm,
  learning_rate_schedule,
  make_optimizer,
  matrix_axes,
  muon_dimension_numbers,
  qk_clip,
  weight_decay_mask,
)
from moejax.training.state import init_state, logical_axes
from moejax.training.step import make_train_step
from pallas_kernels.segments import document_ids


def small_config(layer_pattern="KM", num_dense_layers=1, **optim):
  c = base_config()
  c.data.vocab_size = 300
  m = c.model
  m.d_model = 32
  m.layer_pattern = layer_pattern
  m.num_layers = len(layer_pattern)
  m.num_dense_layers = num_dense_layers
  m.kda.num_heads, m.kda.head_k_dim, m.kda.head_v_dim, m.kda.gate_rank = 2, 16, 16, 8
  m.mla.num_heads, m.mla.q_lora_rank, m.mla.kv_lora_rank = 4, 16, 16
  m.mla.qk_nope_head_dim, m.mla.v_head_dim = 8, 8
  m.attnres.block_size = 2
  m.ffn.hidden_dim = 64
  m.moe.num_experts, m.moe.top_k, m.moe.shared_hidden_dim = 4, 2, 32
  m.moe.latent_dim, m.moe.expert_hidden_dim = 16, 16
  c.optim.update(optim)
  return validate(c)


@pytest.fixture(scope="module")
def model_axes():
  """(flat {path: logical axes}, flat {path: shape}) of the small model, from an abstract init."""
  model = build_model(small_config())
  boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32)))["params"]
  axes = traverse_util.flatten_dict(logical_axes(boxed))
  shapes = traverse_util.flatten_dict(nn.unbox(boxed))
  return axes, {k: tuple(v.shape) for k, v in shapes.items()}


@pytest.mark.parametrize("names, want", [
    (("embed", "mlp"), ((0,), (1,))),
    (("mlp", "embed"), ((0,), (1,))),
    (("embed", "heads", "kv"), ((0,), (1, 2))),
    (("q_lora", "heads", "kv"), ((0,), (1, 2))),
    (("rank", "heads", "kv"), ((0,), (1, 2))),
    (("heads", "kv", "embed"), ((0, 1), (2,))),  # MLA/KDA W_o contracts heads and head dim
    (("expert", "latent", "mlp"), ((1,), (2,))),  # the expert axis is a batch of matrices
    (("expert", "mlp", "latent"), ((1,), (2,))),
    (("vocab", "embed"), None),
    (("embed", "vocab"), None),
    (("embed", "expert"), None),  # router
    (("conv", "heads", "kv"), None),
    (("heads", "kv"), None),  # per-head bias
    (("norm",), None),
    (("embed",), None),
    (("heads",), None),
])
def test_matrix_axes_from_logical_names(names, want):
  assert matrix_axes(names) == want


def test_muon_takes_exactly_the_weight_matrices_of_the_model(model_axes):
  axes, shapes = model_axes
  dims = traverse_util.flatten_dict(muon_dimension_numbers(traverse_util.unflatten_dict(axes)))
  adam = {k for k, d in dims.items() if d is None}
  adam_multi_dim = {"/".join(k) for k in adam if len(shapes[k]) >= 2}
  want_adam_multi_dim = {"embedding", "head", "layer_1/moe/router"} | {
      f"layer_0/kda/{n}" for n in ("conv_q", "conv_k", "conv_v", "dt_bias", "gate_bias")}
  assert adam_multi_dim == want_adam_multi_dim
  assert all(len(shapes[k]) == 1 for k in adam if "/".join(k) not in want_adam_multi_dim)
  for k, d in dims.items():
    if d is None:
      continue
    names = axes[k]
    covered = sorted(d.reduction_axis + d.output_axis)
    batch = [i for i in range(len(names)) if i not in covered]
    assert batch == ([0] if names[0] == "expert" else []), (k, d)
    # The reduction axes are what the layer contracts with its input.
    contracted = {"w_o": ("heads", "kv")}.get(k[-1])
    assert tuple(names[i] for i in d.reduction_axis) == (contracted or (names[covered[0]],)), (k, d)


def _muon_update(grads, params, axes, **optim):
  tx = make_optimizer(small_config(name="muon", warmup_steps=0, grad_clip=0.0, **optim).optim, axes, 10)
  return tx.update(grads, tx.init(params), params)[0]


def test_muon_orthogonalises_each_expert_on_its_own():
  # Expert 0's gradient is 1000x expert 1's: treated as one matrix, expert 1's update would vanish.
  axes = {"w": ("expert", "latent", "mlp")}
  g = jax.random.normal(jax.random.key(0), (2, 16, 24))
  g = g.at[0].multiply(1000.0)
  params = {"w": jnp.zeros((2, 16, 24))}
  u = _muon_update({"w": g}, params, axes, weight_decay=0.0)["w"]
  for e in range(2):
    s = np.linalg.svd(np.asarray(u[e]), compute_uv=False)
    assert s.max() / s.min() < 2.0, (e, s)  # Newton-Schulz: all singular values near one scale
  norms = np.linalg.norm(np.asarray(u).reshape(2, -1), axis=1)
  assert 0.9 < norms[0] / norms[1] < 1.1


# Every layout Muon meets: plain matrices both ways round (the iteration transposes the tall one), an
# expert batch, W_o contracting two axes, and scanned layers in front. The "2" twins share shape and
# axes with another parameter, so Muon orthogonalises them in one stacked group.
_MUON_LAYOUTS = {
    "wide": (("embed", "mlp"), (24, 40)),
    "wide2": (("embed", "mlp"), (24, 40)),
    "experts2": (("expert", "latent", "mlp"), (3, 16, 24)),
    "tall": (("mlp", "embed"), (40, 24)),
    "experts": (("expert", "latent", "mlp"), (3, 16, 24)),
    "w_o": (("heads", "kv", "embed"), (4, 8, 20)),
    "scanned": (("layers", "expert", "mlp", "latent"), (2, 3, 24, 16)),
    "emb": (("vocab", "embed"), (30, 24)),
    "norm": (("norm",), (24,)),
}


def _layout_tree(seed):
  axes = {k: names for k, (names, _) in _MUON_LAYOUTS.items()}
  keys = jax.random.split(jax.random.key(seed), len(_MUON_LAYOUTS))
  values = {k: jax.random.normal(key, shape)
            for key, (k, (_, shape)) in zip(keys, _MUON_LAYOUTS.items(), strict=True)}
  return axes, values


@pytest.mark.parametrize("ns_implementation", ["xla", "interpret"])
def test_muon_in_float32_is_optax_muon(ns_implementation):
  """Independent reference: optax.contrib.muon with the same dimension numbers, momentum, Nesterov,
  consistent-RMS scaling and decays, over three steps (bias corrections differ per step). The AdamW
  side decays only by the mask in moejax, so the reference's decay there is added by hand. Both forms
  of the iteration: einsums, and the symmetric-product kernels (in interpret mode)."""
  axes, params = _layout_tree(0)
  lr, adam_lr, wd = 0.02, 0.003, 0.1
  cfg = small_config(name="muon", lr=lr, adam_lr=adam_lr, weight_decay=wd, warmup_steps=0, grad_clip=0.0,
                     muon_ns_dtype="float32", final_lr_fraction=1.0,
                     muon_ns_implementation=ns_implementation).optim
  ours = make_optimizer(cfg, axes, 10)
  mask = weight_decay_mask(axes)
  ref = optax.contrib.muon(
      lr, beta=cfg.muon_beta, weight_decay=wd, weight_decay_mask=mask, adam_b1=cfg.b1, adam_b2=cfg.b2,
      adam_weight_decay=0.0, adam_learning_rate=adam_lr, consistent_rms=cfg.muon_consistent_rms,
      muon_weight_dimension_numbers=muon_dimension_numbers(axes))
  s_ours, s_ref = ours.init(params), ref.init(params)
  update_ours, update_ref = jax.jit(ours.update), jax.jit(ref.update)
  for step in range(3):
    grads = _layout_tree(step + 1)[1]
    u_ours, s_ours = update_ours(grads, s_ours, params)
    u_ref, s_ref = update_ref(grads, s_ref, params)
    u_ref = {k: u - adam_lr * wd * params[k] if k == "emb" else u for k, u in u_ref.items()}
    chex.assert_trees_all_close(u_ours, u_ref, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("ns_implementation", ["xla", "interpret"])
def test_muon_in_bfloat16_stays_near_float32(ns_implementation):
  """bf16 Newton-Schulz (the default) is not the float32 iteration, but every matrix's update points
  the same way (cosine > 0.99) and its singular values stay in the quintic's band around one."""
  axes, grads = _layout_tree(5)
  params = jax.tree.map(jnp.zeros_like, grads)
  u = {dtype: _muon_update(grads, params, axes, lr=1.0, weight_decay=0.0, muon_ns_dtype=dtype,
                           muon_ns_implementation="xla" if dtype == "float32" else ns_implementation)
       for dtype in ("float32", "bfloat16")}
  for k, (names, _) in _MUON_LAYOUTS.items():
    dims = matrix_axes(names)
    a, b = np.asarray(u["float32"][k]), np.asarray(u["bfloat16"][k])
    assert b.dtype == np.float32, (k, b.dtype)
    if dims is None:
      np.testing.assert_allclose(b, a, rtol=1e-6, err_msg=k)  # the AdamW side does not change
      continue
    assert np.sum(a * b) / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.99, k
    red, out = dims
    batch = [i for i in range(b.ndim) if i not in red + out]
    m = np.transpose(b, batch + list(red) + list(out))
    m = m.reshape(-1, math.prod(b.shape[i] for i in red), math.prod(b.shape[i] for i in out))
    sv = np.linalg.svd(m, compute_uv=False)
    scale = 0.2 * math.sqrt(max(m.shape[1], m.shape[2]))  # consistent_rms * sqrt(max fan)
    assert 0.5 < sv.min() / scale and sv.max() / scale < 1.5, (k, sv.min() / scale, sv.max() / scale)


def test_muon_ns_dtype_is_validated():
  with pytest.raises(ValueError, match="muon_ns_dtype"):
    small_config(name="muon", muon_ns_dtype="float16")
  with pytest.raises(ValueError, match="muon_ns_implementation"):
    small_config(name="muon", muon_ns_implementation="triton")


def test_auto_newton_schulz_takes_the_kernels_on_a_gpu_unless_matrices_are_split(monkeypatch):
  """"auto" is the config's default: "xla" off the GPU; on one, "pallas", except under a mesh that splits
  the matrices themselves (fsdp, tensor), where the kernels would iterate each one whole per device."""
  from moejax.parallel.mesh import make_mesh
  from moejax.training import muon

  assert base_config().optim.muon_ns_implementation == "auto"
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert muon.resolve_ns("auto") == "xla"
  assert muon.resolve_ns("interpret") == "interpret"
  with pytest.raises(ValueError, match="Newton-Schulz implementation 'triton'"):
    muon.resolve_ns("triton")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert muon.resolve_ns("auto") == "pallas"
  assert muon.resolve_ns("xla") == "xla"
  for sizes, want in [({"expert": 8}, "pallas"), ({"data": 2, "expert": 4}, "pallas"),
                      ({"fsdp": 2, "expert": 4}, "xla"), ({"tensor": 2}, "xla")]:
    with jax.set_mesh(make_mesh(**sizes)):
      assert muon.resolve_ns("auto") == want, sizes


def test_weight_decay_mask_of_the_model(model_axes):
  axes, _ = model_axes
  mask = traverse_util.flatten_dict(weight_decay_mask(traverse_util.unflatten_dict(axes)))
  no_decay = {"/".join(k) for k, m in mask.items() if not m}
  for name in no_decay:
    leaf = name.split("/")[-1]
    assert (leaf in ("scale", "query", "A_log", "dt_bias", "gate_bias", "o_norm_scale", "latent_norm",
                     "router")), name
  for name in ("embedding", "head", "layer_0/kda/conv_q", "layer_0/kda/w_o", "layer_1/mla/w_uq",
               "layer_1/moe/expert_up", "layer_0/ffn/down/kernel"):
    assert mask[tuple(name.split("/"))], name
  for name in ("layer_0/kda/dt_bias", "layer_0/kda/A_log", "layer_1/moe/router", "final_norm/scale",
               "layer_1/mla/q_norm/scale"):
    assert not mask[tuple(name.split("/"))], name


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_decoupled_decay_follows_the_mask_on_both_sides(name):
  """With zero gradients the whole update is the decay: -lr * wd * p where masked, else 0. Muon's
  matrices use optim.lr, its AdamW side optim.adam_lr."""
  axes = {"w": ("embed", "mlp"), "emb": ("vocab", "embed"), "norm": ("norm",), "bias": ("heads", "kv")}
  params = {k: jax.random.normal(jax.random.key(i), (4, 6)) for i, k in enumerate(("w", "emb", "bias"))}
  params["norm"] = jnp.full((6,), 2.0)
  zeros = jax.tree.map(jnp.zeros_like, params)
  lr, adam_lr, wd = 0.02, 0.003, 0.1
  tx = make_optimizer(small_config(name=name, lr=lr, adam_lr=adam_lr, weight_decay=wd, warmup_steps=0).optim,
                      axes, 10)
  u = tx.update(zeros, tx.init(params), params)[0]
  w_lr = lr
  emb_lr = adam_lr if name == "muon" else lr
  chex.assert_trees_all_close(u["w"], -w_lr * wd * params["w"], rtol=1e-6)
  chex.assert_trees_all_close(u["emb"], -emb_lr * wd * params["emb"], rtol=1e-6)
  chex.assert_trees_all_equal(u["norm"], jnp.zeros_like(params["norm"]))
  chex.assert_trees_all_equal(u["bias"], jnp.zeros_like(params["bias"]))


@pytest.mark.parametrize("mesh_splits", [False, True])
def test_global_norm_and_its_clip(monkeypatch, mesh_splits):
  """The small leaves reduced as one concatenation (or, on a mesh that splits parameters, each on its
  own) give the float64 norm and clip, below and above the threshold, with optax's empty state."""
  monkeypatch.setattr(optim_lib, "SMALL_LEAF", 8)
  monkeypatch.setattr(optim_lib, "splits_params", lambda mesh: mesh_splits)
  rng = np.random.default_rng(0)
  tree = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32),
          "c": {"d": rng.normal(size=(2,)).astype(jnp.bfloat16), "e": np.float32(rng.normal())}}
  norm = math.sqrt(sum(float(np.sum(np.float64(x) ** 2)) for x in jax.tree.leaves(tree)))
  # A jit of its own (not jax.jit(global_norm), whose trace the other case would reuse).
  np.testing.assert_allclose(jax.jit(lambda t: global_norm(t))(tree), norm, rtol=1e-6)
  for max_norm in (0.5 * norm, 2.0 * norm):
    ours, theirs = clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
    assert jax.tree.structure(ours.init(tree)) == jax.tree.structure(theirs.init(tree))
    got, _ = jax.jit(ours.update)(tree, ours.init(tree))
    chex.assert_trees_all_equal_dtypes(got, tree)
    scale = min(1.0, max_norm / norm)
    for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(tree), strict=True):
      np.testing.assert_allclose(np.float64(g), np.float64(x) * scale,
                                 rtol=1e-2 if x.dtype == jnp.bfloat16 else 1e-6)


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto])
def test_global_norm_of_split_leaves(axis_type):
  """Leaves split over fsdp and tensor are reduced each on its own, with or without the mesh set: on
  an Explicit mesh a concatenation with replicated leaves would be refused."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from moejax.parallel import mesh as meshlib

  mesh = meshlib.make_mesh(fsdp=2, tensor=2, axis_types=(axis_type,) * len(meshlib.MESH_AXES))
  rng = np.random.default_rng(1)
  tree = {"a": (rng.normal(size=(4, 6)), P("fsdp", "tensor")), "b": (rng.normal(size=(6,)), P("tensor")),
          "c": (rng.normal(size=(3,)), P()), "d": (rng.normal(size=(5,)), P())}
  norm = math.sqrt(sum(float(np.sum(x ** 2)) for x, _ in tree.values()))
  tree = {k: jax.device_put(x.astype(np.float32), NamedSharding(mesh, spec)) for k, (x, spec) in tree.items()}
  np.testing.assert_allclose(jax.jit(lambda t: global_norm(t))(tree), norm, rtol=1e-6)
  with jax.set_mesh(mesh):
    np.testing.assert_allclose(jax.jit(lambda t: global_norm(t))(tree), norm, rtol=1e-6)


def test_warmup_cosine_schedule_values():
  cfg = small_config(lr=1e-3, warmup_steps=10, final_lr_fraction=0.1).optim
  f = learning_rate_schedule(cfg, 110)
  # The first update already moves (lr / warmup); the tenth is at the peak.
  np.testing.assert_allclose([f(0), f(4), f(9)], [1e-4, 5e-4, 1e-3], rtol=1e-6)
  # Cosine from the peak at update 9 to 10% of it at the last, update 109: halfway at update 59.
  np.testing.assert_allclose(f(59), 0.5 * (1e-3 + 1e-4), rtol=1e-6)
  np.testing.assert_allclose(f(34), 1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.25)), rtol=1e-6)
  np.testing.assert_allclose([f(109), f(200)], [1e-4, 1e-4], rtol=1e-6)
  # A warmup as long as the run or longer is cut so the peak is still reached, at the last update.
  g = learning_rate_schedule(small_config(lr=1e-3, warmup_steps=50).optim, 20)
  np.testing.assert_allclose([g(0), g(19)], [5e-5, 1e-3], rtol=1e-6)
  # No warmup: the peak from the first update.
  h = learning_rate_schedule(small_config(lr=1e-3, warmup_steps=0, final_lr_fraction=0.1).optim, 11)
  np.testing.assert_allclose([h(0), h(10)], [1e-3, 1e-4], rtol=1e-6)


def _mla_case():
  cfg = ml_collections.FrozenConfigDict(small_config().model)
  x = jax.random.normal(jax.random.key(1), (2, 24, cfg.d_model))
  seg = jnp.array([[1] * 10 + [2] * 14, [5] * 24], jnp.int32)
  mla = GatedMLA(cfg)
  params = nn.unbox(jax.jit(mla.init)(jax.random.key(2), x, seg)["params"])
  # Larger q/k weights spread the heads' max logits well apart.
  params["w_uq"] = params["w_uq"] * jnp.array([1.0, 3.0, 6.0, 10.0])[None, :, None]

  @jax.jit
  def project(params):
    """Queries [B,T,H,K] and the kv latent [B,T,C], and the layer's own sown max logits: through XLA
    attention and the blocked `max_logits` pass, and through the Pallas kernels (interpret mode),
    whose forward pass reports them."""
    q = mla.apply({"params": params}, x, method=GatedMLA.queries)
    c = mla.apply({"params": params}, x, method=GatedMLA.kv_latent)
    sown = [m.apply({"params": params}, x, seg, mutable=["attn_stats"])[1]["attn_stats"]["max_logit"][0]
            for m in (mla, GatedMLA(cfg, attention_impl="interpret"))]
    return q, c, sown

  return cfg, params, seg, project


def _reference_max_logits(project, params, seg, scale):
  """Float64 NumPy: max over causal same-document pairs of q.k * scale, per head."""
  q, c, _ = jax.device_get(project(params))
  k = np.einsum("btc,chk->bthk", np.float64(c), np.asarray(params["w_uk"], np.float64))
  logits = np.einsum("bshk,bthk->bhst", np.float64(q), k) * scale
  doc = np.asarray(document_ids(seg))
  T = seg.shape[1]
  ok = (doc[:, :, None] == doc[:, None, :]) & np.tril(np.ones((T, T), bool))[None]
  return np.max(np.where(ok[:, None], logits, -np.inf), axis=(0, 2, 3))


def test_qk_clip_brings_hot_heads_to_tau_and_leaves_the_rest():
  cfg, params, seg, project = _mla_case()
  scale = cfg.mla.qk_nope_head_dim ** -0.5
  m_H = _reference_max_logits(project, params, seg, scale)
  # The layer's own statistic (what the train step feeds QK-clip) and `max_logits` over blocks
  # smaller than the row both match the reference.
  q, c, sown = project(params)
  for sown_H in sown:
    np.testing.assert_allclose(sown_H, m_H, rtol=1e-5)
  k = jnp.einsum("btc,chk->bthk", c, params["w_uk"])
  blocked = jax.jit(max_logits, static_argnums=(3, 4))(q, k, document_ids(seg), scale, 8)
  np.testing.assert_allclose(blocked, m_H, rtol=1e-5)

  order = np.argsort(m_H)
  tau = 0.5 * (m_H[order[1]] + m_H[order[2]])
  hot = m_H > tau
  assert hot.sum() == 2
  clipped = qk_clip({"layer": {"mla": params}}, {("layer", "mla"): jnp.asarray(m_H, jnp.float32)},
                    float(tau))["layer"]["mla"]
  new_H = _reference_max_logits(project, clipped, seg, scale)
  np.testing.assert_allclose(new_H[hot], tau, rtol=1e-5)
  np.testing.assert_array_equal(new_H[~hot], m_H[~hot])
  for name in ("w_uq", "w_uk"):
    np.testing.assert_array_equal(np.asarray(clipped[name])[:, ~hot], np.asarray(params[name])[:, ~hot])
  # Query and key share the shrink evenly (alpha = 1/2).
  ratio = np.asarray(clipped["w_uq"][0, :, 0] / params["w_uq"][0, :, 0])
  np.testing.assert_allclose(ratio[hot], np.sqrt(tau / m_H[hot]), rtol=1e-5)
  for name in params:
    if name not in ("w_uq", "w_uk"):
      chex.assert_trees_all_equal(clipped[name], params[name])


def test_muon_train_step_with_qk_clip():
  """A jitted Muon step with QK-clip stays finite, and after it every MLA head's max logit sits
  at tau: the initial maxima are all above tau, so every head was clipped."""
  # One MLA layer with a dense FFN keeps the compile short; Muon on experts is tested above.
  config = small_config("M", 1, name="muon", lr=1e-4, adam_lr=1e-4, warmup_steps=0, qk_clip_tau=1.0)
  model = build_model(config)
  state, optimizer, _ = init_state(model, config, jax.random.key(0), 10)
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, 300, (4, 32)).astype(np.int32)
  seg = np.repeat(np.array([[1] * 20 + [2] * 12]), 4, axis=0).astype(np.int32)
  batch = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "segment_ids": seg,
           "positions": np.zeros_like(tokens), "loss_mask": np.ones(tokens.shape, np.float32)}

  @jax.jit
  def head_max(params):
    _, stats = model.apply({"params": params, "balance": state.balance}, tokens, seg,
                           mutable=["router", "attn_stats"])
    return stats["attn_stats"]["layer_0"]["mla"]["max_logit"][0]

  # Scale W_uq so each head starts well above tau.
  state = state.replace(params=jax.tree_util.tree_map_with_path(
      lambda p, w: w * 4.0 if "w_uq" in jax.tree_util.keystr(p) else w, state.params))
  before = np.asarray(head_max(state.params))
  assert before.min() > 2.0, before
  step = jax.jit(make_train_step(model, optimizer, config, 10))
  for i in range(3):
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"])) and bool(metrics["finite"])
    if i == 0:
      # lr is small, so the update moves the logits far less than the clip: all heads near tau.
      np.testing.assert_allclose(head_max(state.params), 1.0, rtol=0.05)
  schedules = {k: learning_rate_schedule(config.optim, 10) for k in ("lr", "adam_lr")}
  for k, f in schedules.items():
    assert float(metrics[k]) == pytest.approx(float(f(2)), rel=1e-6)


def test_like_matrices_are_orthogonalised_as_one_group():
  """orthogonalise_many stacks arrays of one shape, layout and key: one Newton-Schulz (5 steps x 3
  matmuls) per group, the same result per matrix as alone; a different key keeps arrays apart."""
  from moejax.training.muon import orthogonalise, orthogonalise_many

  dims = [MuonDimensionNumbers(1, 2)] * 3 + [MuonDimensionNumbers(0, 1)]
  xs = [jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(2, 8, 12)] * 3 + [(12, 8)])]

  def matmuls(keys):
    jaxpr = jax.make_jaxpr(lambda xs: orthogonalise_many(xs, dims, jnp.float32, keys=keys))(xs)
    return sum(e.primitive.name == "dot_general" for e in jaxpr.eqns)

  assert matmuls(None) == 2 * 15  # the three [2, 8, 12] together, the [12, 8] alone
  assert matmuls(["a", "a", "b", "a"]) == 3 * 15
  for dtype in (jnp.float32, jnp.bfloat16):
    got = orthogonalise_many(xs, dims, dtype)
    want = [orthogonalise(x, d, dtype) for x, d in zip(xs, dims, strict=True)]
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
