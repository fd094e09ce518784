"""Masked block access for the Triton-lowered Pallas kernels (gmm, quantile): a mask of None means the
block is whole, so the evenly divisible case compiles without masks."""

import functools

import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton


def next_pow2(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1): Triton block shapes must be powers of two."""
  return 1 << max(0, n - 1).bit_length()


def mask_and(*masks):
  """The conjunction of the masks that are not None; None when all are."""
  masks = [mk for mk in masks if mk is not None]
  if not masks:
    return None
  return functools.reduce(jnp.logical_and, masks)


def load(ref, mask, other=0):
  """ref's block, with `other` where mask is False."""
  if mask is None:
    return ref[...]
  return pltriton.load(ref, mask=mask, other=other)


def store(ref, x, mask):
  """x into ref's block where mask is True."""
  if mask is None:
    ref[...] = x
  else:
    pltriton.store(ref, x, mask=mask)
