"""Packed rows: documents are runs of equal consecutive segment ids. Shared by the kernels and the model."""

import jax.numpy as jnp


def document_ids(segment_ids_BT):
  """Row-local document index: 0 at position 0, +1 wherever the segment id changes.

  A document starts wherever the id changes from the previous position, so ids may repeat
  (e.g. [3,3,5,5,3]) without two separate documents comparing equal.
  """
  changed_BT = jnp.concatenate(
      [jnp.zeros_like(segment_ids_BT[:, :1], dtype=jnp.int32),
       (segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]).astype(jnp.int32)], axis=1)
  return jnp.cumsum(changed_BT, axis=1, dtype=jnp.int32)
