"""The train state: everything a run carries, and where it lives on a mesh.

`TrainState` holds step, params, optimizer state, the routing balance state (router biases and load
statistics, which get no gradient) and the rng. Checkpoints save this pytree whole, so a resumed run
continues bit-exactly.
"""

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from moejax.model import Transformer, init_variables, tied_head
from moejax.parallel import mesh as meshlib
from moejax.training.optimizers import make_optimizer


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  balance: Any  # the model's "balance" collection: router biases and accumulated loads per MoE layer
  rng: jax.Array  # raw uint32 key data
  bad_steps: jax.Array  # consecutive non-finite steps (the update was skipped)


def logical_axes(boxed_params):
  """Tree of logical-axis tuples, one per parameter, from nn.Partitioned boxes."""
  return jax.tree.map(lambda p: tuple(p.names) if isinstance(p, nn.Partitioned) else (None,) * p.ndim,
                      boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def is_logical_axes(x) -> bool:
  """Whether x is a leaf of a `logical_axes` tree: a tuple of axis names (or None)."""
  return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def head_matrix(params, cfg_model):
  return tied_head(params["embedding"]) if cfg_model.tie_embeddings else params["head"]


def _state_builder(model: Transformer, config, total_steps: int):
  """(build, abstract, optimizer, logical_axes): `build(rng)` makes the initial TrainState (under jit it
  allocates nothing until compiled); `abstract` is its shapes, from one trace of the model's init."""
  key = jax.random.key(0)
  boxed = jax.eval_shape(lambda r: init_variables(model, r), key)
  axes = logical_axes(boxed["params"])
  optimizer = make_optimizer(config.optim, axes, total_steps)

  def build(rng):
    init_rng, state_rng = jax.random.split(rng)
    variables = init_variables(model, init_rng)
    params = nn.unbox(variables["params"])
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                      balance=variables.get("balance", {}),
                      rng=jax.random.key_data(state_rng),  # raw uint32, which checkpoints as a plain array
                      bad_steps=jnp.zeros((), jnp.int32))

  params = nn.unbox(boxed["params"])
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  abstract = TrainState(step=scalar, params=params, opt_state=jax.eval_shape(optimizer.init, params),
                        balance=boxed.get("balance", {}), rng=jax.eval_shape(jax.random.key_data, key),
                        bad_steps=scalar)
  return build, abstract, optimizer, axes


def abstract_state(model: Transformer, config, total_steps: int):
  """(state, optimizer, logical_axes) with the state as shapes (jax.ShapeDtypeStruct): nothing is
  allocated, and the model's init is traced once."""
  _, abstract, optimizer, axes = _state_builder(model, config, total_steps)
  return abstract, optimizer, axes


def init_state(model: Transformer, config, rng: jax.Array, total_steps: int, device=None):
  """Returns (state, optimizer, logical_axes); the state is computed on and lives on `device` (default:
  the first local device; the host's CPU device, say, for a state too slow to draw on the GPU)."""
  build, _, optimizer, axes = _state_builder(model, config, total_steps)
  # Committed to the device, as a restored checkpoint is: otherwise a fresh and a resumed run lower
  # the step with different sharding annotations and each compiles it anew.
  device = jax.local_devices()[0] if device is None else device
  state = jax.jit(build, out_shardings=jax.sharding.SingleDeviceSharding(device))(rng)
  return state, optimizer, axes


def sharded_state_plan(model: Transformer, config, total_steps: int, mesh):
  """(template, init, optimizer, shardings): the state as shapes placed on `mesh` (jax.ShapeDtypeStruct
  with `state_shardings`), which a checkpoint restores into, and `init(rng)`, which computes the fresh
  state in that placement, each device only its own shards.

  Nothing is allocated until `init` runs. A resumed run restores into the template and never draws the
  fresh state: drawn first, its buffers freed only after the restored ones were allocated leave a hole
  in the device's memory, where the step's largest buffer may no longer find room (a resumed
  experiments/h200.py run, drawn and then restored, ran out of memory on an 80 GiB H100 where the
  fresh run fitted)."""
  build, abstract, optimizer, axes = _state_builder(model, config, total_steps)
  shardings = state_shardings(abstract, axes, mesh)
  template = jax.tree.map(lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                          abstract, shardings)
  return template, jax.jit(build, out_shardings=shardings), optimizer, shardings


def shard_state(state: TrainState, axes, mesh) -> TrainState:
  """`state` placed on `mesh` by `state_shardings`. Run the step under `jax.set_mesh(mesh)`."""
  return jax.device_put(state, state_shardings(state, axes, mesh))


def state_shardings(state: TrainState, axes, mesh) -> TrainState:
  """Where each leaf of `state` (arrays or their shapes) goes on `mesh`: params split by their logical
  axes (moejax.parallel.mesh rules), each optimizer-state leaf that mirrors a parameter (a moment:
  its path ends in the parameter's path, with its shape) as that parameter, everything else
  replicated. Give the result to `jit_train_step` too, so that the step hands the state back as it
  takes it."""
  params = jax.tree.map(lambda names, p: meshlib.named_sharding(names, p.shape, mesh), axes, state.params,
                        is_leaf=is_logical_axes)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  by_path = {tuple(k.key for k in path): (tuple(p.shape), sharding) for (path, p), sharding in
             zip(jax.tree_util.tree_flatten_with_path(state.params)[0], jax.tree.leaves(params), strict=True)}

  def follow(path, leaf):
    keys = []  # the dict keys that end the leaf's path: where a params-shaped tree sits in the state
    for k in reversed(path):
      if not isinstance(k, jax.tree_util.DictKey):
        break
      keys.insert(0, k.key)
    for i in range(len(keys)):
      shape, sharding = by_path.get(tuple(keys[i:]), (None, None))
      if shape == tuple(leaf.shape):
        return sharding
    return replicated

  return state.replace(params=params, opt_state=jax.tree_util.tree_map_with_path(follow, state.opt_state),
                       balance=jax.tree.map(lambda _: replicated, state.balance),
                       step=replicated, rng=replicated, bad_steps=replicated)


def applied_updates(opt_state) -> jax.Array:
  """How many updates the optimizer has applied: its step `count`. Skipped (non-finite) steps keep
  the whole old optimizer state, so every count in the chain stays equal to this."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    if getattr(path[-1], "name", getattr(path[-1], "key", None)) == "count":
      return leaf
  raise ValueError("the optimizer state holds no step count")
