"""Gradient accumulation (train.microbatch_tokens): a step in several passes against the same step in
one, and the routing balance chained from pass to pass.

The steps here apply the plain negative gradient (an optax schedule of -1 with a step count), so the
new parameters are params - grads and compare gradients directly, QK-clip included.
"""

from collections.abc import Mapping

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moejax.config import base_config, validate
from moejax.model import build_model, init_variables
from moejax.moe.balance import next_balance_state
from moejax.moe.layer import EXPERT_WEIGHTS
from moejax.training import optimizers as optim_lib
from moejax.training import step as train_step
from moejax.training.accumulation import AccumulatorLayout
from moejax.training.state import TrainState
from moejax.training.step import make_train_step

ROWS, SEQ = 4, 32


def small_config(balance: str, microbatch_tokens: int, qk_clip_tau: float = 0.0, rows: int = ROWS,
                 mesh: dict | None = None, moe_token_chunk: int = 0):
  c = base_config()
  c.data.vocab_size = 300
  m = c.model
  m.d_model = 32
  m.layer_pattern, m.num_layers, m.num_dense_layers = "KM", 2, 0
  m.kda.num_heads, m.kda.head_k_dim, m.kda.head_v_dim, m.kda.gate_rank = 2, 16, 16, 8
  m.mla.num_heads, m.mla.q_lora_rank, m.mla.kv_lora_rank = 2, 16, 16
  m.mla.qk_nope_head_dim, m.mla.v_head_dim = 8, 8
  m.attnres.block_size = 2
  m.moe.num_experts, m.moe.top_k, m.moe.shared_hidden_dim = 4, 2, 32
  m.moe.latent_dim, m.moe.expert_hidden_dim = 16, 16
  m.moe.balance = balance
  m.moe.token_chunk = moe_token_chunk
  m.moe.aux_loss_weight = 0.1  # large enough to matter under "aux"
  c.optim.qk_clip_tau = qk_clip_tau
  c.train.stages = ((SEQ, 10, rows * SEQ),)
  c.train.mesh.update(mesh or {})
  c.train.microbatch_tokens = microbatch_tokens
  return validate(c)


def batch_of(seed: int = 0, rows: int = ROWS) -> dict:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, 300, (rows, SEQ)).astype(np.int32)
  # Documents of several lengths, and loss masks with different weight per row, so that the passes
  # hold different shares of the batch's loss.
  seg = np.repeat(np.array([[1] * 20 + [2] * 12]), rows, axis=0).astype(np.int32)
  seg[0] = np.repeat([1, 2, 3, 4], SEQ // 4)  # two passes of two rows hold 6 and 3 documents
  seg[1] = 1
  density = np.resize([0.9, 0.3, 0.6, 1.0, 0.5, 0.8, 0.2, 0.7], rows)[:, None]
  mask = (rng.random((rows, SEQ)) < density).astype(np.float32)
  return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "segment_ids": seg,
          "positions": np.zeros_like(tokens), "loss_mask": mask}


@pytest.fixture
def layouts(monkeypatch):
  """The accumulator layouts the steps traced in the test build, in order."""
  made = []

  class Recorded(AccumulatorLayout):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      made.append(self)

  monkeypatch.setattr(train_step, "AccumulatorLayout", Recorded)
  return made


def gradient_step(config):
  """(jitted step, state) with the update params - grads."""
  model = build_model(config)
  variables = init_variables(model, jax.random.key(0))
  params = nn.unbox(variables["params"])
  optimizer = optax.scale_by_schedule(lambda count: -1.0)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                     balance=variables["balance"], rng=jax.random.key_data(jax.random.key(1)),
                     bad_steps=jnp.zeros((), jnp.int32))
  return jax.jit(make_train_step(model, optimizer, config, 10)), state, model


# All of this model's gradients are small enough for the flat accumulator; a threshold of 512
# elements sends the embedding, the experts (1024 each) and the wider projections to their own
# accumulators, and the experts' to the model (the grouped matmuls' drhs kernels add them; with MoE
# token chunks of 32, two per pass, nn.add_to_gradient). mask_scale 0.01: fractional loss masks whose
# sum in a pass is below 1, which the cross-entropy divides by 1 rather than by the sum.
@pytest.mark.parametrize("balance, small_gradient, mask_scale, moe_token_chunk",
                         [("none", 512, 1.0, 0), ("aux", None, 0.01, 32)])
def test_passes_give_the_one_pass_step(balance, small_gradient, mask_scale, moe_token_chunk, monkeypatch,
                                       layouts):
  """Without a bias that moves between passes, two passes of two rows give the one-pass step's
  gradients, loss, token counts and loads; QK-clip (on for every head) takes the max logit over both."""
  if small_gradient is not None:
    monkeypatch.setattr(optim_lib, "SMALL_LEAF", small_gradient)
  ref_step, state, _ = gradient_step(small_config(balance, 0, qk_clip_tau=0.01))
  acc_step, _, _ = gradient_step(small_config(balance, 2 * SEQ, qk_clip_tau=0.01,
                                              moe_token_chunk=moe_token_chunk))
  batch = batch_of()
  batch["loss_mask"] = batch["loss_mask"] * np.float32(mask_scale)
  assert mask_scale == 1.0 or 0 < batch["loss_mask"][0::2].sum() < 1  # pass 0: rows 0 and 2
  want, want_m = ref_step(state, batch)
  got, got_m = acc_step(state, batch)
  (layout,) = layouts
  assert any(layout.small) and (small_gradient is None) == all(layout.small)
  in_model = sorted(key[-1] for key in layout.in_model if key is not None)
  assert in_model == ([] if small_gradient is None else sorted(EXPERT_WEIGHTS * 2)), in_model  # 2 layers
  # The sequence-wise aux loss is a mean over a pass's documents, weighted by the pass's share of them.
  chex.assert_trees_all_close(got.params, want.params, rtol=2e-5, atol=2e-6)
  for name in ("loss", "nll", "z_loss", "tokens", "aux_loss", "grad_norm"):
    np.testing.assert_allclose(got_m[name], want_m[name], rtol=1e-5, err_msg=name)
  if balance == "aux":
    assert float(got_m["aux_loss"]) > 0
  chex.assert_trees_all_close(got.balance, want.balance, rtol=1e-6)
  loads = {k: v for k, v in want_m.items() if k.endswith("/load")}
  assert loads
  chex.assert_trees_all_close({k: got_m[k] for k in loads}, loads, rtol=1e-6)


def test_passes_with_scanned_layers_accumulate_stacked_experts(monkeypatch, layouts):
  """Scanned layers: the stacked experts' accumulators go into the scan with their params' leading
  layers axis, each period's MoE adds its own slice, in the grouped matmul's kernels (interpret mode);
  two passes give the one-pass step."""
  monkeypatch.setattr(optim_lib, "SMALL_LEAF", 512)
  configs = []
  for tokens in (0, 2 * SEQ):
    c = small_config("none", tokens).unlock()
    c.model.update(num_layers=6, scan_layers=True)
    # The kernels under test in the passes; the one-pass reference takes XLA's grouped matmul (the same
    # function), which compiles faster than the kernels in interpret mode.
    c.model.moe.grouped_matmul = "interpret" if tokens else "xla"
    configs.append(validate(c))
  ref_step, state, _ = gradient_step(configs[0])
  acc_step, _, _ = gradient_step(configs[1])
  batch = batch_of(3)
  want, want_m = ref_step(state, batch)
  got, got_m = acc_step(state, batch)
  (layout,) = layouts
  stacked = [shape for (shape, _), key in zip(layout.shapes, layout.in_model, strict=True)
             if key is not None and len(shape) == 4]
  assert stacked, layout.in_model  # [layers, experts, in, out]
  # Against each leaf's update (the gradient here): XLA orders the scanned sums otherwise than the
  # one-pass step's, which moved the worst leaf by 8e-5 of its largest update (the same with every
  # gradient in the flat accumulator); a pass's gradient lost or added twice moves it by O(1).
  def check(path, new, ref, old):
    err = np.max(np.abs(np.asarray(new) - ref)) / np.max(np.abs(np.asarray(ref) - old))
    assert err < 1e-3, (jax.tree_util.keystr(path), err)

  jax.tree_util.tree_map_with_path(check, got.params, want.params, state.params)
  np.testing.assert_allclose(got_m["grad_norm"], want_m["grad_norm"], rtol=1e-5)


def test_accumulators_the_model_does_not_take_are_an_error(monkeypatch):
  """A module that holds an expert weight but reads no accumulator would lose the earlier passes'
  gradients: the step refuses to trace."""
  from moejax.moe.layer import MoE
  monkeypatch.setattr(optim_lib, "SMALL_LEAF", 512)
  monkeypatch.setattr(MoE, "_grad_accumulators", lambda self, w: None)
  step, state, _ = gradient_step(small_config("none", 2 * SEQ))
  with pytest.raises(ValueError, match="did not take the gradient accumulators"):
    step(state, batch_of())


def test_accumulator_layout_sums_small_and_large_gradients(monkeypatch):
  """Small float32 and bfloat16 gradients go through the flat vector, large ones through their own
  accumulators; the sums come back in the params' tree, its order and dtypes."""
  monkeypatch.setattr(optim_lib, "SMALL_LEAF", 6)
  rng = np.random.default_rng(0)
  params = {"b": np.zeros((2, 3), np.float32), "a": {"w": np.zeros((4, 5), np.float32),
                                                      "s": np.zeros((3,), jnp.bfloat16)},
            "c": np.zeros((), np.float32)}
  layout = AccumulatorLayout(params)
  assert layout.small == [True, False, True, True]  # leaves in key order: a/s, a/w, b, c
  with pytest.MonkeyPatch.context() as mp:  # a mesh that splits parameters: each on its own
    mp.setattr(optim_lib, "splits_params", lambda mesh: True)
    assert AccumulatorLayout(params).small == [False] * 4
  grads = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(p.dtype), params) for _ in range(3)]
  acc = layout.zeros()
  for g in grads:
    acc = layout.add(acc, g)
  got = layout.gradients(acc)
  want = jax.tree.map(lambda p, *gs: sum(np.float32(g) for g in gs).astype(p.dtype), params, *grads)
  chex.assert_trees_all_equal_dtypes(got, params)
  chex.assert_trees_all_close(got, want, rtol=1e-6)


def _is_layer(tree) -> bool:
  return isinstance(tree, Mapping) and "load" in tree


@pytest.mark.parametrize("balance", ["quantile", "sign"])
def test_each_pass_routes_with_the_balance_of_the_pass_before(balance):
  """Pass p (rows p and p + 2 of four) routes with the balance state that pass p - 1 left (pass 0 with
  the step's), and the step keeps the last pass's: under "quantile" the bias pass 1 computed, under
  "sign" two sign steps; every pass's load is added to load_total and to the step's load metric."""
  config = small_config(balance, 2 * SEQ)
  step, state, model = gradient_step(config)
  state = state.replace(balance=jax.tree.map(lambda b: b + jnp.linspace(-0.2, 0.2, b.shape[0]),
                                             state.balance))
  batch = batch_of(1)
  new, metrics = step(state, batch)

  balance_state, loads = state.balance, []
  for p in range(2):
    _, stats = model.apply({"params": state.params, "balance": balance_state}, batch["tokens"][p::2],
                           batch["segment_ids"][p::2], mutable=["router"])
    loads.append(jax.tree.map(lambda s: s["load"], stats["router"], is_leaf=_is_layer))
    balance_state = next_balance_state(balance, balance_state, stats["router"], config.model.moe)
  chex.assert_trees_all_close(new.balance, balance_state, rtol=1e-5, atol=1e-6)
  total_load = jax.tree.map(lambda *x: sum(x), *loads)
  for layer, load in total_load.items():
    got = metrics[f"moe/{layer}/moe/load"]
    np.testing.assert_allclose(got, load["moe"] / np.mean(load["moe"]), rtol=1e-6)
  # The bias the passes handed on moved: each pass balanced its own row.
  assert not np.allclose(new.balance["layer_1"]["moe"]["bias"], state.balance["layer_1"]["moe"]["bias"])


def test_passes_trace_the_model_once():
  """The passes run in a scan: one pass's forward and backward is traced once, not once per pass."""
  config = small_config("none", SEQ)
  step, state, model = gradient_step(config)
  calls = []
  apply = model.apply

  def counting_apply(variables, tokens, *args, **kwargs):
    calls.append(tokens.shape[0])
    return apply(variables, tokens, *args, **kwargs)

  object.__setattr__(model, "apply", counting_apply)
  step.lower(state, batch_of())  # traced, which is what is counted; compiling it would add nothing
  assert calls == [1]  # once, with one pass's row


# data x expert: the experts exchanged by all-to-all, the small gradients each in its own accumulator;
# data alone: parameters replicated, so the small gradients go through the flat one.
@pytest.mark.parametrize("mesh_axes", [{"data": 2, "expert": 2}])
def test_passes_on_a_mesh_match_one_device(mesh_axes, layouts):
  """Two passes of four rows on a mesh of four devices (each pass split over the row shards) give the
  one-pass step on one device."""
  from moejax.parallel import mesh as meshlib

  rows = 8
  ref_step, state, _ = gradient_step(small_config("none", 0, rows=rows))
  config = small_config("none", 4 * SEQ, rows=rows, mesh=mesh_axes)
  mesh_step, _, _ = gradient_step(config)
  batch = batch_of(2, rows)
  want, want_m = ref_step(state, batch)
  mesh = meshlib.make_mesh(**config.train.mesh, axis_types=(jax.sharding.AxisType.Auto,) * 4)
  with jax.set_mesh(mesh):  # traced here: the MoE layers split over the mesh's axes
    got, got_m = mesh_step(state, jax.device_put(batch, meshlib.batch_sharding(mesh)))
  (layout,) = layouts
  assert all(layout.small) == ("expert" not in mesh_axes) and any(layout.small) == all(layout.small)
  # Split experts are accumulated by the model outside its shard_map (nn.add_to_gradient).
  assert any(key is not None for key in layout.in_model) == ("expert" in mesh_axes)
  chex.assert_trees_all_close(jax.device_get(got.params), want.params, rtol=2e-5, atol=2e-6)
  for name in ("loss", "nll", "tokens", "grad_norm", "moe/dropped"):
    np.testing.assert_allclose(got_m[name], want_m[name], rtol=1e-5, err_msg=name)


def test_a_step_without_parameter_updates_still_balances():
  """train.update_params=False: the loss and the balance state are the updating step's (in two passes,
  whose balance updates chain); the parameters and the optimizer state stay as they were. The choice
  comes after the passes, so one pass takes it alike."""
  config = small_config("quantile", 2 * SEQ)
  step, state, _ = gradient_step(config)
  frozen_config = small_config("quantile", 2 * SEQ)
  frozen_config.unlock().train.update_params = False
  frozen_step, _, _ = gradient_step(validate(frozen_config))
  updated, metrics = step(state, batch_of(0))
  frozen, frozen_metrics = frozen_step(state, batch_of(0))
  chex.assert_trees_all_equal(frozen.params, state.params)
  chex.assert_trees_all_equal(frozen.opt_state, state.opt_state)
  chex.assert_trees_all_close(frozen.balance, updated.balance)
  assert not np.allclose(frozen.balance["layer_1"]["moe"]["bias"], state.balance["layer_1"]["moe"]["bias"])
  np.testing.assert_allclose(frozen_metrics["loss"], metrics["loss"], rtol=1e-6)
  assert int(frozen.step) == 1
