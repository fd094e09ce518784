"""Expert parallelism on 8 CPU devices: both exchanges against the dropless single-device layer.

The ragged exchange cannot run on XLA:CPU; its bookkeeping runs here with an emulation of
jax.lax.ragged_all_to_all built from all_gather, and the real op is checked to lower.
"""

import contextlib
import functools
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moejax.config import base_config
from moejax.moe import expert_parallel as ep
from moejax.moe.dispatch import dropless_moe
from moejax.moe.layer import MoE
from moejax.parallel import mesh as meshlib

AXES = ("data", "expert")


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
  """jax.lax.ragged_all_to_all semantics from all_gather: every output row looks up its sender."""
  del recv_sizes  # implied by the senders' sizes
  parts, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
  per = input_offsets.shape[0] // parts
  gather = functools.partial(jax.lax.all_gather, axis_name=axis_name)
  ops = gather(operand)
  mine = me * per + jnp.arange(per)
  ins, sizes, outs = (gather(a)[:, mine] for a in (input_offsets, send_sizes, output_offsets))
  rows = jnp.arange(output.shape[0])
  hit = ((rows[:, None, None] >= outs) & (rows[:, None, None] < outs + sizes)).reshape(len(rows), -1)
  which = jnp.argmax(hit, axis=1)
  src, slot = which // per, which % per
  src_row = jnp.clip(ins[src, slot] + rows - outs[src, slot], 0, operand.shape[0] - 1)
  return jnp.where(hit.any(axis=1)[:, None], ops[src, src_row], output)


def skewed_routing(rng, m, n, k):
  probs = np.exp(1.5 * rng.standard_normal(n))
  probs /= probs.sum()
  return np.stack([rng.choice(n, k, replace=False, p=probs) for _ in range(m)]).astype(np.int32)


def expected_keep(idx, shards, parts, n, cf):
  """Which (token, slot) pairs both exchanges keep, by direct counting in numpy: each owner keeps the
  first ceil(cf * rows) of its pairs in (expert, source, position) order."""
  m, k = idx.shape
  e_loc, rows = n // parts, (m // shards) * k
  pairs = idx.reshape(shards, rows)  # shard i = data group i // parts, expert rank i % parts
  keep = np.zeros((shards, rows), bool)
  buffer_rows = min(parts * rows, math.ceil(cf * rows))
  for group in range(shards // parts):
    for owner in range(parts):
      offset = 0
      for e in range(owner * e_loc, (owner + 1) * e_loc):
        for s in range(parts):
          for r in np.flatnonzero(pairs[group * parts + s] == e):
            keep[group * parts + s, r] = offset < buffer_rows
            offset += 1
  return keep.reshape(m, k)


def run_exchange(exchange, x, idx, p, weights, n, cf):
  """y and dropped from the expert-parallel function on a 2 x 4 (data x expert) mesh."""
  impl = {"padded": ep.padded_expert_parallel,
          "ragged": functools.partial(ep.ragged_expert_parallel, exchange=emulated_ragged_all_to_all)}
  fn = functools.partial(impl[exchange], num_experts=n, capacity_factor=cf, b1=4.0, b2=25.0)

  def per_shard(x, idx, p, *w):
    y, dropped = fn(x, idx, p, *w)
    return y, jax.lax.psum(dropped, AXES)

  mapped = jax.shard_map(per_shard, in_specs=(P(AXES),) * 3 + (P("expert"),) * 3, out_specs=(P(AXES), P()))

  @jax.jit
  def run(x, p, w, idx):
    specs = (P(AXES),) * 3 + (P("expert"),) * 3
    (y, dropped), vjp = jax.vjp(lambda x, p, w: mapped(*jax.tree.map(jax.reshard, (x, idx, p, *w), specs)),
                                x, p, w)
    return y, dropped, vjp((jnp.ones_like(y) * jnp.arange(y.shape[1]), jnp.zeros_like(dropped)))

  with jax.set_mesh(meshlib.make_mesh(data=2, expert=4)):
    return run(x, p, weights, idx)


@pytest.mark.parametrize("exchange,cf", [("padded", 4.0), ("padded", 0.75), ("padded", 0.3), ("ragged", 4.0),
                                         ("ragged", 0.75), ("ragged", 0.3)])
def test_exchange_matches_dropless_reference(exchange, cf):
  """cf = 4 = P is dropless; cf = 0.75 and 0.3 drop exactly the pairs that overflow an owner, the same
  pairs in both exchanges, and count them."""
  rng = np.random.default_rng(0)
  m, k, n, lat, f = 64, 3, 8, 6, 5
  idx = skewed_routing(rng, m, n, k)
  x = jnp.asarray(rng.standard_normal((m, lat)), jnp.float32)
  p = jnp.asarray(rng.uniform(0.1, 1.0, (m, k)), jnp.float32)
  weights = tuple(jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), jnp.float32)
                  for s in ((n, lat, f), (n, lat, f), (n, f, lat)))
  keep = expected_keep(idx, 8, 4, n, cf)
  assert keep.all() == (cf == 4.0)

  y, dropped, grads = run_exchange(exchange, x, jnp.asarray(idx), p, weights, n, cf)

  def reference(x, p, w):
    return dropless_moe(x, jnp.asarray(idx), p * keep, *w, 4.0, 25.0)

  y_ref, vjp = jax.vjp(reference, x, p, weights)
  assert int(dropped) == int((~keep).sum())
  chex.assert_trees_all_close(y, y_ref, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(grads, vjp(jnp.ones_like(y_ref) * jnp.arange(lat)), atol=1e-5, rtol=1e-4)


def ep_cfg(**moe):
  c = base_config().model
  c.d_model = 16
  c.moe.update(dict(num_experts=16, top_k=3, num_shared=1, shared_hidden_dim=8, latent_dim=8,
                    expert_hidden_dim=6, capacity_factor=8.0, balance="quantile"))
  c.moe.update(moe)
  return ml_collections.FrozenConfigDict(c)


def layer_setup(cfg, batch=8, seq=4):
  rng = np.random.default_rng(1)
  model = MoE(cfg)
  x = jnp.asarray(rng.standard_normal((batch, seq, cfg.d_model)), jnp.float32)
  abstract = jax.eval_shape(model.init, jax.random.key(0), x)
  params = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape) / np.sqrt(a.shape[-2]), a.dtype)
                        if a.ndim > 1 else jnp.ones(a.shape, a.dtype), nn.unbox(abstract["params"]))
  balance = {"bias": jnp.asarray(0.2 * rng.standard_normal(cfg.moe.num_experts), jnp.float32),
             "load_total": jnp.zeros((cfg.moe.num_experts,), jnp.float32)}
  return model, x, params, balance


def layer_fwd_bwd(model, params, balance, x):
  """y, the sown stats, and the gradients of sum(y * ct) with respect to params and x."""

  @jax.jit
  def run(params, x):
    def loss(params, x):
      y, stats = model.apply({"params": params, "balance": balance}, x, mutable=("router",))
      ct = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
      return jnp.sum(y * ct), (y, stats["router"])

    (_, (y, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, stats, grads

  return run(params, x)


@pytest.fixture(scope="module")
def single_device():
  cfg = ep_cfg()
  model, x, params, balance = layer_setup(cfg)
  return cfg, model, x, params, balance, layer_fwd_bwd(model, params, balance, x)


@pytest.mark.parametrize("shape", [dict(expert=8), dict(data=2, expert=4)])
def test_layer_on_mesh_equals_single_device(single_device, shape):
  cfg, model, x, params, balance, (y0, stats0, grads0) = single_device
  with jax.set_mesh(meshlib.make_mesh(**shape)):
    x_in = jax.device_put(x, P("data", None, None) if "data" in shape else P(None, None, None))
    y, stats, grads = layer_fwd_bwd(model, params, balance, x_in)
  assert y.sharding.spec == x_in.sharding.spec  # the output keeps the input's sharding
  chex.assert_trees_all_close(y, y0, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(grads, grads0, atol=1e-5, rtol=1e-4)
  np.testing.assert_array_equal(stats["load"], stats0["load"])
  assert int(stats["dropped"]) == 0
  # The histogram quantile (psum'd bins) and the exact one may pick different points in the gap
  # between two margins; both are mean-zero and close.
  assert abs(float(stats["bias_next"].mean())) < 1e-5
  chex.assert_trees_all_close(stats["bias_next"], stats0["bias_next"], atol=0.05)


@pytest.mark.parametrize("shape", [None, dict(expert=8)])
def test_token_chunks_equal_one_pass(single_device, shape):
  """moe.token_chunk runs the routed experts over 2-token chunks (16 of them on one device, 2 per shard
  on the mesh), rematerialised: the same outputs, loads and gradients as one pass."""
  _, _, x, params, balance, (y0, stats0, grads0) = single_device
  model = MoE(ep_cfg(token_chunk=2))
  with jax.set_mesh(meshlib.make_mesh(**shape)) if shape else contextlib.nullcontext():
    y, stats, grads = layer_fwd_bwd(model, params, balance, x)
  chex.assert_trees_all_close(y, y0, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(grads, grads0, atol=1e-5, rtol=1e-4)
  np.testing.assert_array_equal(stats["load"], stats0["load"])
  assert int(stats["dropped"]) == 0


def test_token_chunk_that_does_not_divide_is_an_error(single_device):
  _, _, x, params, balance, _ = single_device
  with pytest.raises(ValueError, match="token_chunk=5 does not divide the 32 tokens"):
    MoE(ep_cfg(token_chunk=5)).apply({"params": params, "balance": balance}, x, mutable=("router",))


def test_layer_counts_dropped_pairs():
  cfg = ep_cfg(capacity_factor=0.5, balance="none")
  model, x, params, balance = layer_setup(cfg)
  with jax.set_mesh(meshlib.make_mesh(expert=8)):
    _, stats = jax.jit(model.apply, static_argnames="mutable")(
        {"params": params, "balance": balance}, x, mutable=("router",))
  assert int(stats["router"]["dropped"]) > 0


def test_ragged_layer_lowers_on_cpu():
  """The GPU path traces and lowers (forward and backward) with the real ragged_all_to_all."""
  cfg = ep_cfg()
  model, x, params, balance = layer_setup(cfg)
  model = MoE(cfg, exchange="ragged")

  def loss(params, x):
    return jnp.sum(model.apply({"params": params, "balance": balance}, x) ** 2)

  with jax.set_mesh(meshlib.make_mesh(data=2, expert=4)):
    text = jax.jit(jax.grad(loss)).lower(params, x).as_text()
  assert text.count("ragged_all_to_all") >= 4  # two exchanges, and their transposes


def test_mesh_helpers_and_errors():
  mesh = meshlib.make_mesh(data=2, expert=4)
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
  assert meshlib.token_axes(mesh) == ("data", "fsdp", "expert") and meshlib.token_shards(mesh) == 8
  with pytest.raises(ValueError, match="needs 16 devices"):
    meshlib.make_mesh(data=4, expert=4)
  with pytest.raises(ValueError, match="positive integer"):
    meshlib.make_mesh(data=0)
  assert meshlib.logical_spec(("expert", "latent", "mlp")) == P("expert", None, "tensor")
  assert meshlib.logical_spec(("batch", None)) == P(("data", "fsdp", "expert"), None)
  with pytest.raises(ValueError, match="no rule"):
    meshlib.logical_spec(("nonsense",))
  # Parameters are split over fsdp, expert and tensor; over data they are replicated.
  assert meshlib.splits_params(mesh) and not meshlib.splits_params(meshlib.make_mesh(data=8))
  assert not meshlib.splits_params(None) and not meshlib.splits_params(jax.sharding.get_abstract_mesh())
  for axis in ("fsdp", "tensor"):
    assert meshlib.splits_params(jax.sharding.AbstractMesh(
        tuple(2 if a == axis else 1 for a in meshlib.MESH_AXES), meshlib.MESH_AXES))

  cfg = ep_cfg()
  model = MoE(cfg)
  x = jax.ShapeDtypeStruct((8, 4, cfg.d_model), jnp.float32)
  shardings = meshlib.param_shardings(jax.eval_shape(model.init, jax.random.key(0), x)["params"], mesh)
  assert shardings["expert_gate"].spec == P("expert", None, "tensor")
  assert shardings["router"].spec == P("fsdp", "expert")

  bad = ep_cfg(num_experts=12)
  model, x, params, balance = layer_setup(bad)
  with jax.set_mesh(meshlib.make_mesh(expert=8)), pytest.raises(ValueError, match="not divisible by"):
    model.apply({"params": params, "balance": balance}, x)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="batch size 4"):
    model.apply({"params": params, "balance": balance}, x[:4])


def test_train_step_on_a_data_x_expert_mesh_matches_one_device():
  """The whole jitted train step (model, loss, Muon, balance update) with its state placed on a
  2x4 data x expert mesh by `shard_state` equals the same step on one device, over two steps.

  Sign balancing: its update is exact under data parallelism, so step 2 routes identically too (the
  quantile bias comes from histograms across shards, equal to the exact one within a bin: tested in
  test_balance, and enough to change a top-k choice here and there)."""
  import pathlib

  from benchmarks import step_setup
  from moejax.model import build_model
  from moejax.training.state import init_state, state_shardings
  from moejax.training.step import jit_train_step, make_train_step

  # Newton-Schulz in float32: bf16 rounding would turn the float noise between the two placements'
  # gradients into update differences beyond this test's tolerance.
  h200 = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "h200.py"
  config = step_setup.load_config(str(h200),
                                  ["model.moe.balance=sign", "optim.muon_ns_dtype=float32"], smoke=True)
  model = build_model(config)
  state, optimizer, axes = init_state(model, config, jax.random.key(0), 10)
  batch = step_setup.synthetic_batch(config, 8, 64, mean_doc=20)
  mesh = step_setup.make_mesh({"data": 2, "expert": 4})
  shardings = state_shardings(state, axes, mesh)
  sharded = jax.device_put(state, shardings)
  assert sharded.params["layer_1"]["moe"]["expert_gate"].sharding.spec[0] == "expert"
  # The optimizer's moments sit where their parameter does: Muon's of the expert weights split over
  # the experts, and Adam's of the router as the router.
  moments = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(sharded.opt_state)[0]:
    keys = tuple(getattr(k, "key", None) for k in path[-3:])
    moments.setdefault(keys, []).append(leaf.sharding.spec)
  moe = sharded.params["layer_1"]["moe"]
  assert moments[("layer_1", "moe", "expert_gate")] == [moe["expert_gate"].sharding.spec]
  router = moe["router"].sharding.spec
  assert len(moments[("layer_1", "moe", "router")]) == 2 and router[-1] == "expert"
  assert all(spec == router for spec in moments[("layer_1", "moe", "router")])
  specs = lambda state: jax.tree.map(lambda a: a.sharding.spec, state)
  placed = specs(sharded)
  step = jax.jit(make_train_step(model, optimizer, config, 10))
  single_rows, mesh_rows = [], []
  for _ in range(2):
    state, m = step(state, batch)
    single_rows.append(m)
  mesh_step = jit_train_step(model, optimizer, config, 10, shardings)
  with jax.set_mesh(mesh):
    sharded_batch = jax.device_put(batch, meshlib.batch_sharding(mesh))
    for _ in range(2):
      sharded, m = mesh_step(sharded, sharded_batch)
      assert specs(sharded) == placed  # handed back as taken: the next call reuses the compiled step
      mesh_rows.append(m)
  assert mesh_step._cache_size() == 1
  for a, b in zip(single_rows, mesh_rows, strict=True):
    assert float(b["moe/dropped"]) == 0
    for key in ("loss", "grad_norm", "moe/maxvio_batch"):
      np.testing.assert_allclose(float(b[key]), float(a[key]), rtol=2e-5, err_msg=key)
  chex.assert_trees_all_close(jax.device_get(sharded.params), jax.device_get(state.params), atol=2e-5,
                              rtol=2e-4)


def test_bf16x3_router_on_mesh_equals_single_device():
  """The router's bf16 tensor-core logits (a custom VJP) inside the expert-parallel shard_map: the
  weight's gradient is summed over the token shards, as the float32 router's is."""
  c = ep_cfg(router_matmul="bf16x3").as_configdict()
  c.dtype = "bfloat16"
  cfg = ml_collections.FrozenConfigDict(c)
  model, x, params, balance = layer_setup(cfg)
  y0, _, grads0 = layer_fwd_bwd(model, params, balance, x)
  with jax.set_mesh(meshlib.make_mesh(data=2, expert=4)):
    y, _, grads = layer_fwd_bwd(model, params, balance, jax.device_put(x, P("data", None, None)))
  f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
  chex.assert_trees_all_close(f32(y), f32(y0), atol=2e-2, rtol=2e-2)
  chex.assert_trees_all_close(f32(grads[0]["router"]), f32(grads0[0]["router"]), atol=1e-4, rtol=1e-3)
