"""What a packed row's layers know of its documents, worked out once per row by the model.

A packed row holds several documents one after another; `segment_ids` mark them (a document starts
wherever the id changes). Every layer that must keep documents apart (KDA's state and convolution,
MLA's attention, the router's per-document aux loss) reads the same row-local document index, so the
model computes it once (`Packing.of`) and hands it down instead of each layer deriving it again.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.segments import document_ids


def check_segment_ids(segment_ids_BT, batch: int, length: int):
  """Raises ValueError unless segment ids are an integer [batch, length] array."""
  shape = tuple(segment_ids_BT.shape)
  if shape != (batch, length):
    raise ValueError(f"segment_ids must have shape [B,T]=({batch}, {length}), got {shape}")
  if not jnp.issubdtype(segment_ids_BT.dtype, jnp.integer):
    raise ValueError(f"segment_ids must be an integer array, got dtype {segment_ids_BT.dtype}")


class Packing(NamedTuple):
  """document_ids_BT: int32 [B,T], 0 at position 0 and +1 wherever a document starts. Being
  non-decreasing, it is itself a valid segment-id array for the kernels."""

  document_ids_BT: jax.Array

  @classmethod
  def of(cls, segment_ids_BT, batch: int, length: int) -> "Packing":
    """The packing of [batch, length] rows marked by `segment_ids_BT`."""
    check_segment_ids(segment_ids_BT, batch, length)
    return cls(document_ids(segment_ids_BT))

  def positions_BT(self) -> jax.Array:
    """Each token's position within its document (0 at every document start)."""
    T = self.document_ids_BT.shape[1]
    index_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), self.document_ids_BT.shape)
    start_BT = jnp.where(self.document_ids_BT != jnp.pad(self.document_ids_BT, ((0, 0), (1, 0)),
                                                         constant_values=-1)[:, :-1], index_BT, 0)
    return index_BT - jax.lax.cummax(start_BT, axis=1)

  def documents_B(self) -> jax.Array:
    """How many documents each row holds: documents never cross rows."""
    return self.document_ids_BT[:, -1] + 1


class Appended(NamedTuple):
  """Tokens appended to the rows' decode caches (`moejax.inference`): row b's first `lengths_B[b]`
  tokens are real and the rest pad it to the batch's common length. Pads reach no state or cache: a
  KDA layer's recurrent state and convolution history stay as the last real token left them, and an
  MLA layer writes no latent for them. Their outputs are meaningless, and a row of length 0 leaves its
  caches as they were."""

  lengths_B: jax.Array  # int32 [B], each in [0, T]

  def valid_BT(self, length: int) -> jax.Array:
    """bool [B, length]: which positions of each row are real tokens."""
    return jnp.arange(length, dtype=jnp.int32)[None, :] < self.lengths_B[:, None]


def document_ids_of(packing: "Packing | jax.Array | None", batch: int, length: int) -> jax.Array | None:
  """A layer's packing argument as row-local document ids [batch, length]: a Packing's as they are,
  segment ids' (a layer called on its own, outside the model) worked out here, and None (one
  document a row) as None, which lets a layer take its single-document paths."""
  if packing is None:
    return None
  if isinstance(packing, Packing):
    if tuple(packing.document_ids_BT.shape) != (batch, length):
      raise ValueError(f"packing.document_ids_BT has shape {tuple(packing.document_ids_BT.shape)}, "
                       f"want [B,T]=({batch}, {length})")
    return packing.document_ids_BT
  return Packing.of(packing, batch, length).document_ids_BT
