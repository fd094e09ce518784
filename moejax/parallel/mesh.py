"""Device mesh with named axes, and the logical-axis -> mesh-axis rules.

Mesh axes, outermost first: data, fsdp, expert, tensor (every mesh built here has all four; unused
ones have size 1). Tokens (the batch dimension) are split over data, fsdp and expert together, so an
expert-parallel group also shares the data-parallel work; routed experts are split over `expert`.
Within an expert group, the MoE layer sends tokens to the experts' owners by all-to-all
(`moejax.moe.expert_parallel`).

Rules are MaxText-style pairs (logical name, mesh axis or tuple of axes or None). Parameters carry
their logical names (`moejax.nn.logical_param`); `param_shardings` maps a boxed param tree to
NamedShardings with them.
"""

import math

import flax.linen as nn
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.nn import LAYERS_AXIS

MESH_AXES = ("data", "fsdp", "expert", "tensor")
TOKEN_AXES = ("data", "fsdp", "expert")
EXPERT_AXIS = "expert"

LOGICAL_AXIS_RULES = (
    ("batch", TOKEN_AXES),
    ("expert", "expert"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("vocab", "tensor"),
    ("kv", None),
    ("q_lora", None),
    ("kv_lora", None),
    ("latent", None),
    ("norm", None),
    ("conv", None),
    ("rank", None),
    ("grid", None),  # the cells of the vision tower's position table
    (LAYERS_AXIS, None),  # the stacking axis of scanned layers (moejax/model.py)
)


def make_mesh(data: int = 1, expert: int = 1, fsdp: int = 1, tensor: int = 1, *, devices=None,
              axis_types=None) -> jax.sharding.Mesh:
  """A (data, fsdp, expert, tensor) mesh over the first data*fsdp*expert*tensor devices.

  Axis types default to jax.make_mesh's (Explicit). Use it with `jax.set_mesh(mesh)`.
  """
  sizes = {"data": data, "fsdp": fsdp, "expert": expert, "tensor": tensor}
  for name, size in sizes.items():
    if not isinstance(size, int) or size < 1:
      raise ValueError(f"mesh axis {name!r} must have a positive integer size, got {size!r}")
  devices = list(jax.devices() if devices is None else devices)
  needed = math.prod(sizes.values())
  if needed > len(devices):
    raise ValueError(f"mesh {sizes} needs {needed} devices, only {len(devices)} available")
  shape = tuple(sizes[a] for a in MESH_AXES)
  kwargs = {} if axis_types is None else {"axis_types": axis_types}
  return jax.make_mesh(shape, MESH_AXES, devices=devices[:needed], **kwargs)


def axis_size(mesh, name: str) -> int:
  """Size of a mesh axis, 1 when the mesh (abstract or concrete) has no such axis."""
  return dict(mesh.shape).get(name, 1) if mesh is not None and not mesh.empty else 1


def token_axes(mesh) -> tuple[str, ...]:
  """The mesh axes that split tokens, in mesh order (only those the mesh has)."""
  if mesh is None or mesh.empty:
    return ()
  return tuple(a for a in mesh.axis_names if a in TOKEN_AXES)


def token_shards(mesh) -> int:
  return math.prod(axis_size(mesh, a) for a in token_axes(mesh))


def splits_params(mesh, rules=LOGICAL_AXIS_RULES) -> bool:
  """Whether `mesh` (abstract or concrete; None or empty: no) has more than one shard on an axis
  that `rules` map a parameter's logical axis to (every rule but the batch's)."""
  param_axes = set()
  for name, axes in rules:
    if name != "batch":
      param_axes.update((axes,) if isinstance(axes, str) else axes or ())
  return any(axis_size(mesh, a) > 1 for a in param_axes)


def logical_spec(names, rules=LOGICAL_AXIS_RULES) -> P:
  """PartitionSpec for a tuple of logical axis names (None stays unsharded)."""
  table = dict(rules)
  for name in names:
    if name is not None and name not in table:
      raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
  spec, used = [], set()
  for name in names:
    axes = table.get(name) if name is not None else None
    axes_t = (axes,) if isinstance(axes, str) else tuple(axes or ())
    if used & set(axes_t):  # a mesh axis can split only one dimension
      raise ValueError(f"logical axes {names} map mesh axes {axes_t} twice")
    used |= set(axes_t)
    spec.append(axes)
  return P(*spec)


def named_sharding(names, shape, mesh, rules=LOGICAL_AXIS_RULES) -> NamedSharding:
  """NamedSharding of an array with logical axis `names`, checking that each split divides."""
  spec = logical_spec(names, rules)
  for dim, axes in zip(shape, spec, strict=True):
    parts = math.prod(axis_size(mesh, a) for a in ((axes,) if isinstance(axes, str) else axes or ()))
    if dim % parts:
      raise ValueError(f"param of shape {shape} with logical axes {names}: dimension {dim} "
                       f"is not divisible by the {parts} shards of mesh axes {axes}")
  return NamedSharding(mesh, spec)


def param_shardings(boxed_params, mesh, rules=LOGICAL_AXIS_RULES):
  """NamedSharding per leaf of a param tree whose leaves are nn.Partitioned (e.g. from eval_shape)."""

  def one(leaf):
    if isinstance(leaf, nn.Partitioned):
      return named_sharding(leaf.names, nn.unbox(leaf).shape, mesh, rules)
    return NamedSharding(mesh, P())

  return jax.tree.map(one, boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def batch_sharding(mesh) -> NamedSharding:
  """Rows of a batch split over the token axes (data, fsdp, expert)."""
  return NamedSharding(mesh, P(token_axes(mesh)))


def is_explicit(mesh) -> bool:
  """Whether every axis of a non-empty mesh is Explicit (sharding in types, jax.make_mesh's default)."""
  return not mesh.empty and set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}


def constrain(x, spec: P):
  """Puts x in `spec` on the ambient mesh: jax.reshard for Explicit axes, a constraint for Auto ones."""
  mesh = jax.sharding.get_abstract_mesh()
  types = set(mesh.axis_types)
  if is_explicit(mesh):
    return jax.reshard(x, spec)
  if types == {jax.sharding.AxisType.Auto}:
    return jax.lax.with_sharding_constraint(x, spec)
  raise ValueError(f"the MoE layer needs a mesh whose axes are all Explicit or all Auto, got {types}")
