"""Packed-document helpers and the causal depthwise short convolution of the KDA mixer (DESIGN §2)."""

import jax.numpy as jnp

from pallas_kernels.segments import document_ids
from pallas_kernels.short_conv import conv_silu, short_conv

__all__ = ["check_segment_ids", "conv_silu", "document_ids", "short_conv"]


def check_segment_ids(segment_ids_BT, batch: int, length: int):
  """Raises ValueError unless segment ids are an integer [batch, length] array."""
  shape = tuple(segment_ids_BT.shape)
  if shape != (batch, length):
    raise ValueError(f"segment_ids must have shape [B,T]=({batch}, {length}), got {shape}")
  if not jnp.issubdtype(segment_ids_BT.dtype, jnp.integer):
    raise ValueError(f"segment_ids must be an integer array, got dtype {segment_ids_BT.dtype}")
