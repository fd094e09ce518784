"""Shape checks and packed-segment helpers shared by every KDA implementation.

Only what is cheap to check is checked: ranks, shapes and dtypes. The gate bound g in [lb, 0) is the
caller's contract (checking it would need a device reduction and a host sync).
"""

from typing import NamedTuple

import jax.numpy as jnp


class Dims(NamedTuple):
  B: int
  T: int
  H: int
  K: int
  V: int


def _shape(x):
  return tuple(x.shape)


def check_inputs(q, k, v, g, beta, initial_state=None, segment_ids=None) -> Dims:
  """Validates fla-layout inputs and returns their sizes; raises ValueError naming the problem."""
  for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
    if getattr(x, "ndim", None) != rank:
      raise ValueError(f"{name} must have rank {rank}, got shape {getattr(x, 'shape', type(x))}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
  B, T, H, K = _shape(q)
  V = v.shape[-1]
  if _shape(k) != (B, T, H, K):
    raise ValueError(f"k shape {_shape(k)} must equal q shape {(B, T, H, K)} [B,T,H,K]")
  if _shape(g) != (B, T, H, K):
    raise ValueError(f"g shape {_shape(g)} must equal q shape {(B, T, H, K)} [B,T,H,K]")
  if _shape(v)[:3] != (B, T, H):
    raise ValueError(f"v shape {_shape(v)} must be [B,T,H,V] with B,T,H = {(B, T, H)} from q")
  if _shape(beta) != (B, T, H):
    raise ValueError(f"beta shape {_shape(beta)} must be [B,T,H] = {(B, T, H)}")
  if min(B, T, H, K, V) == 0:
    raise ValueError(f"empty input: B,T,H,K,V = {(B, T, H, K, V)}")
  if initial_state is not None:
    if _shape(initial_state) != (B, H, K, V):
      raise ValueError(f"initial_state shape {_shape(initial_state)} must be [B,H,K,V] = {(B, H, K, V)}")
    if not jnp.issubdtype(initial_state.dtype, jnp.floating):
      raise ValueError(f"initial_state must be floating point, got dtype {initial_state.dtype}")
  if segment_ids is not None:
    if _shape(segment_ids) != (B, T):
      raise ValueError(f"segment_ids shape {_shape(segment_ids)} must be [B,T] = {(B, T)}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be an integer array, got dtype {segment_ids.dtype}")
  return Dims(B, T, H, K, V)


def resolve_scale(scale, K: int):
  if scale is not None and jnp.ndim(scale) != 0:
    raise ValueError(f"chunk_kda: scale must be a scalar (None: K**-0.5), got shape {jnp.shape(scale)}")
  return K**-0.5 if scale is None else scale


def resets(segment_ids_BT):
  """Bool [B,T]: True where a new document starts, except position 0; None without segment ids.

  Position 0 always starts a document, but there the initial state applies instead of a reset,
  so it is not flagged. A document starts wherever the id changes from the previous position.
  """
  if segment_ids_BT is None:
    return None
  changed_BT = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
  return jnp.pad(changed_BT, ((0, 0), (1, 0)))
