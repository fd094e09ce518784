"""Per-device bytes of the train state on a mesh, from the abstract shapes of the real state.

`abstract_state` takes the shapes of `moejax.training.state.abstract_state`, so nothing is
allocated (K3's 2.78T parameters cost a trace). `StateLayout` places those shapes on a
jax.sharding.AbstractMesh with `state_shardings`, the function a run places its state with, and reads
each leaf's per-device shard shape off its NamedSharding: the bytes a run would hold, on a mesh of any
size, whatever devices this machine has.
"""

import copy
import dataclasses
import functools
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType

from moejax.model import build_model
from moejax.moe.layer import EXPERT_WEIGHTS
from moejax.parallel.mesh import MESH_AXES, TOKEN_AXES
from moejax.training import state as state_lib

_TRACED: dict[str, "AbstractState"] = {}


@dataclasses.dataclass(frozen=True)
class AbstractState:
  state: Any  # a TrainState of jax.ShapeDtypeStruct leaves
  axes: Any  # the params' logical axes (moejax.training.state.logical_axes)

  @functools.cached_property
  def param_leaves(self) -> list[tuple[tuple[str, ...], Any]]:
    """(path as key names, shape) of every parameter, in tree order: the same for every mesh."""
    return [(_keys(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(self.state.params)[0]]


def shape_key(config) -> str:
  """What the state's shapes depend on: the model and the optimizer, not the batch or the mesh."""
  return json.dumps([config.model.to_dict(), config.optim.to_dict()], sort_keys=True, default=str)


def abstract_state(config) -> AbstractState:
  """The train state of `config` as shapes, traced once per model and optimizer in this process."""
  key = shape_key(config)
  if key not in _TRACED:
    _TRACED[key] = _trace_state(config)
  return _TRACED[key]


def _trace_state(config) -> AbstractState:
  config = copy.deepcopy(config)
  # The shapes do not depend on the mesh, and the mesh's own rules are checked per candidate.
  config.train.mesh.update({axis: 1 for axis in MESH_AXES})
  model = build_model(config)
  total_steps = sum(steps for _, steps, _ in config.train.stages)
  state, _, axes = state_lib.abstract_state(model, config, total_steps)
  return AbstractState(state, axes)


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
  """A mesh of `sizes` with no devices behind it, Auto axes as a run's (moejax.training.loop)."""
  return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                      axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _bytes(leaf, sharding, dtype=None) -> int:
  itemsize = jnp.dtype(dtype or leaf.dtype).itemsize
  return math.prod(sharding.shard_shape(tuple(leaf.shape))) * itemsize


def _split_axes(sharding, sizes) -> dict[str, int]:
  """The mesh axes (of size > 1) that split a leaf, with their sizes."""
  axes = {}
  for entry in sharding.spec:
    for axis in (entry,) if isinstance(entry, str) else entry or ():
      if sizes[axis] > 1:
        axes[axis] = sizes[axis]
  return axes


@dataclasses.dataclass(frozen=True)
class ParamLeaf:
  """One parameter as one device holds it."""
  path: tuple[str, ...]
  shard_bytes: int
  grad_shard_bytes: int  # its gradient: float32, or the parameter's wider type (accumulation.py)
  split: dict[str, int]  # mesh axes that split it -> their sizes
  in_moe_shard_map: bool  # a weight of the MoE's routed half, which shard_map takes (moe/layer.py)
  routed_expert: bool  # split over `expert` inside that shard_map, gathered over the rest

  @property
  def gathered(self) -> dict[str, int]:
    """The axes a layer all-gathers it over to use it: inside the MoE's shard_map all but `expert` for
    the experts' weights and all for the others (its in_specs); elsewhere `fsdp` (a tensor-split
    weight is used split, Megatron-style)."""
    if self.in_moe_shard_map:
      return {a: n for a, n in self.split.items() if not (self.routed_expert and a == "expert")}
    return {a: n for a, n in self.split.items() if a == "fsdp"}

  def gathered_bytes(self, gradient: bool = False) -> int:
    """Its bytes gathered for use, or those of its gradient at that size before the reduction."""
    return (self.grad_shard_bytes if gradient else self.shard_bytes) * math.prod(self.gathered.values())

  @property
  def reduced_over(self) -> tuple[str, ...]:
    """The token axes whose devices hold the same shard of it and so sum their gradients of it."""
    return tuple(a for a in TOKEN_AXES if a not in self.split)


def _keys(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """The state of `AbstractState` split over a mesh of `sizes`: what one device holds."""
  sizes: dict[str, int]
  params: list[ParamLeaf]
  optimizer_bytes: int
  other_bytes: int  # step, balance state (router biases and loads), rng, bad-step count
  scan_repeats: int  # how many layers each "scanned" parameter stacks (moejax.layout.layer_layout)

  @property
  def param_bytes(self) -> int:
    return sum(p.shard_bytes for p in self.params)

  @property
  def gradient_bytes(self) -> int:
    return sum(p.grad_shard_bytes for p in self.params)

  def layer_gathered_bytes(self, gradient: bool = False) -> int:
    """The most bytes one decoder layer's weights (or their gradients) take gathered (scanned layers:
    one of the stacked layers)."""
    per_layer: dict[tuple, float] = {}
    for p in self.params:
      if p.path[0] == "scanned":
        key, share = p.path[:2], 1 / self.scan_repeats
      elif p.path[0].startswith("layer_"):
        key, share = p.path[:1], 1
      else:
        continue
      per_layer[key] = per_layer.get(key, 0) + p.gathered_bytes(gradient) * share
    return int(max(per_layer.values(), default=0))


def state_layout(abstract: AbstractState, sizes: dict[str, int], scan_repeats: int) -> StateLayout:
  """Places the abstract state on a mesh of `sizes`. Raises ValueError (from
  moejax.parallel.mesh.named_sharding) when a parameter's split does not divide its dimension."""
  state = abstract.state
  shardings = state_lib.state_shardings(state, abstract.axes, abstract_mesh(sizes))
  row_shards = math.prod(sizes[a] for a in TOKEN_AXES)
  params, flat_p = [], abstract.param_leaves
  wide = {dtype: jnp.promote_types(dtype, jnp.float32) for dtype in {leaf.dtype for _, leaf in flat_p}}
  for (keys, leaf), sharding in zip(flat_p, jax.tree.leaves(shardings.params), strict=True):
    # The MoE's own weights are direct children of its "moe" module; shared experts sit deeper.
    in_map = row_shards > 1 and len(keys) >= 2 and keys[-2] == "moe"
    params.append(ParamLeaf(
        path=keys, shard_bytes=_bytes(leaf, sharding),
        grad_shard_bytes=_bytes(leaf, sharding, wide[leaf.dtype]),
        split=_split_axes(sharding, sizes), in_moe_shard_map=in_map,
        routed_expert=in_map and keys[-1] in EXPERT_WEIGHTS))

  def total(*fields):
    leaves = jax.tree.leaves([getattr(state, f) for f in fields])
    placed = jax.tree.leaves([getattr(shardings, f) for f in fields])
    return sum(_bytes(x, s) for x, s in zip(leaves, placed, strict=True))

  return StateLayout(sizes=dict(sizes), params=params, optimizer_bytes=total("opt_state"),
                     other_bytes=total("step", "balance", "rng", "bad_steps"), scan_repeats=scan_repeats)
