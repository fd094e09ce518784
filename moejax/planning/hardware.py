"""The planner's stated hardware: each card's data-sheet dense bf16 rate and memory, and the links.

Nothing here is measured. The step time scales the peak by an assumed model FLOPs utilisation, and the
links are taken per GPU and per direction: NVLink between the GPUs of a node, InfiniBand across nodes.
Devices are numbered row-major over the mesh axes (data, fsdp, expert, tensor: tensor fastest), as
`moejax.parallel.mesh.make_mesh` lays them out, with `gpus_per_node` consecutive devices on a node.
"""

import dataclasses
import itertools
import math

from moejax.device_memory import default_memory_fraction
from moejax.parallel.mesh import MESH_AXES

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Card:
  name: str
  peak_flops: float  # dense bf16 FLOP/s per card, the data sheet's (no sparsity)
  memory_bytes: float  # the card's HBM

  @property
  def usable_bytes(self) -> float:
    """What a run lets XLA take: the memory fraction that `python -m moejax.train` asks for."""
    return self.memory_bytes * default_memory_fraction()


CARDS = {
    "h100": Card("H100 SXM", 989.4e12, 80 * GIB),
    "h200": Card("H200", 989.4e12, 141e9),
}


@dataclasses.dataclass(frozen=True)
class Links:
  nvlink_bytes_per_s: float = 450e9  # per GPU, per direction, within a node
  ib_bytes_per_s: float = 50e9  # per GPU across nodes: InfiniBand 400 Gb/s
  gpus_per_node: int = 8

  def group(self, sizes: dict[str, int], axes) -> tuple[int, int]:
    """(devices in a group that differ only along `axes`, how many of them share device 0's node)."""
    strides = {a: math.prod(sizes[b] for b in MESH_AXES[i + 1:]) for i, a in enumerate(MESH_AXES)}
    axes = [a for a in axes if sizes[a] > 1]
    ids = [sum(i * strides[a] for i, a in zip(index, axes, strict=True))
           for index in itertools.product(*(range(sizes[a]) for a in axes))]
    return len(ids), sum(i < self.gpus_per_node for i in ids)

  def ring_seconds(self, nbytes: float, sizes: dict[str, int], axes) -> float:
    """A ring collective (all-gather, reduce-scatter, all-reduce) sending `nbytes` per device: at the
    NVLink rate within a node, else at the InfiniBand rate, which every ring across nodes passes."""
    members, local = self.group(sizes, axes)
    if members <= 1 or not nbytes:
      return 0.0
    return nbytes / (self.nvlink_bytes_per_s if local == members else self.ib_bytes_per_s)

  def all_to_all_seconds(self, nbytes: float, sizes: dict[str, int], axes) -> float:
    """An all-to-all sending `nbytes` per device spread evenly over the other members: the share for
    peers on the node over NVLink, the rest over InfiniBand, at the same time."""
    members, local = self.group(sizes, axes)
    if members <= 1 or not nbytes:
      return 0.0
    near = (local - 1) / (members - 1)
    return max(nbytes * near / self.nvlink_bytes_per_s, nbytes * (1 - near) / self.ib_bytes_per_s)
