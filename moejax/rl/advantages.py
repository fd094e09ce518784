"""Group-relative advantages, and the reward shaping and group filtering that come before them.

GRPO samples N answers to each of G prompts and scores each answer against its own group: the
advantage of sample n of group g is (r_gn - mean_g r) / (std_g r + eps). No value model is learnt.
"""

import jax.numpy as jnp
import numpy as np

EPS = 1e-6


def group_advantages(rewards_GN, *, scale: str = "std"):
  """[G groups, N samples] -> [G, N] float32: r - the group's mean, divided by (the group's sample
  standard deviation (ddof=1) + 1e-6) under scale="std", left so under scale="none" (Dr. GRPO).

  A group of one sample has no spread: its std is taken as 0 (not ddof=1's 0/0 = NaN), so its single
  advantage is 0 / 1e-6 = 0. A group whose rewards are all equal gets advantages of 0 as well: it
  carries no learning signal (`informative_groups` drops such groups before the update).
  """
  if scale not in ("std", "none"):
    raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
  r = jnp.asarray(rewards_GN, jnp.float32)
  if r.ndim != 2 or r.shape[0] < 1 or r.shape[1] < 1:
    raise ValueError(f"rewards must be [groups, samples] with both >= 1, got shape {r.shape}")
  centred = r - jnp.mean(r, axis=1, keepdims=True)
  if scale == "none":
    return centred
  n = r.shape[1]
  if n == 1:
    return jnp.zeros_like(r)
  std = jnp.sqrt(jnp.sum(centred ** 2, axis=1, keepdims=True) / (n - 1))
  return centred / (std + EPS)


def informative_groups(rewards_GN) -> np.ndarray:
  """[G] bool: the groups whose rewards are not all equal (DAPO's dynamic sampling keeps these and
  refills the batch with new groups in place of the others)."""
  r = np.asarray(rewards_GN, np.float64)
  return np.ptp(r, axis=1) > 0


def overlong_penalty(lengths, *, max_length: int, cache: int):
  """DAPO's soft overlong punishment: 0 for responses up to max_length - cache tokens, then falling
  linearly to -1 at max_length, and -1 beyond it. Added to the task reward."""
  if cache < 0 or cache > max_length:
    raise ValueError(f"need 0 <= cache <= max_length, got cache={cache}, max_length={max_length}")
  n = np.asarray(lengths, np.float64)
  if cache == 0:
    return np.where(n > max_length, -1.0, 0.0)
  return np.clip((max_length - cache - n) / cache, -1.0, 0.0)
