"""Scoring long rows through the prefill path: each row fed to the decode caches in pieces, and every
position's target scored on the way, so a row of a million tokens needs the memory of one piece plus
the caches (KDA states of fixed size, MLA latents linear in the length), never the whole row's
activations.

    scores = score_rows(lm, tokens_BT, targets_BT, lengths_B)
    scores.nll_BT      # -log p(target) at each position, float32 (0 past a row's length)
    scores.argmax_BT   # the greedy prediction at each position (-1 past a row's length)
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.inference.engine import bucket
from moejax.model import Transformer, init_cache


class Scores(NamedTuple):
  nll_BT: np.ndarray
  argmax_BT: np.ndarray


def _score_piece(model: Transformer, variables, cache, tokens_BP, targets_BP, lengths_B):
  h_BPD, cache = model.apply(variables, tokens_BP, cache=cache, lengths_B=lengths_B)
  logits_BPV = model.apply(variables, h_BPD, method=Transformer.logits).astype(jnp.float32)
  logp_BPV = jax.nn.log_softmax(logits_BPV, axis=-1)
  nll_BP = -jnp.take_along_axis(logp_BPV, targets_BP[..., None], axis=-1)[..., 0]
  return cache, nll_BP, jnp.argmax(logits_BPV, axis=-1).astype(jnp.int32)


@functools.cache
def _program(model: Transformer):
  # One program per model (a Transformer is a frozen, hashable dataclass); jit keys its compiles by the
  # piece and cache shapes.
  return jax.jit(functools.partial(_score_piece, model), donate_argnums=(1,))


def piece_length(lm, longest: int, piece: int | None = None) -> int:
  """The pieces' length: a power of two, at most `piece` (default inference.prefill_chunk)."""
  piece = lm.prefill_chunk if piece is None else int(piece)
  if piece < 1:
    raise ValueError(f"piece must be >= 1, got {piece}")
  return min(bucket(longest, 16), bucket(piece))


def score_rows(lm, tokens_BT, targets_BT, lengths_B=None, *, piece: int | None = None) -> Scores:
  """Every position's negative log-likelihood of its target and greedy prediction, for rows of one
  document each (row b's first lengths_B[b] positions; default all), fed in pieces of `piece` tokens.

  The same numbers as one plain forward pass over each row (moejax.inference.LanguageModel.logits), up
  to the order of floating-point sums."""
  tokens_BT, targets_BT = np.asarray(tokens_BT, np.int32), np.asarray(targets_BT, np.int32)
  if tokens_BT.ndim != 2 or tokens_BT.shape != targets_BT.shape:
    raise ValueError(f"tokens and targets must be [B, T] of one shape, got {tokens_BT.shape} and "
                     f"{targets_BT.shape}")
  B, T = tokens_BT.shape
  lengths_B = np.full((B,), T, np.int32) if lengths_B is None else np.asarray(lengths_B, np.int32)
  if lengths_B.shape != (B,) or lengths_B.min(initial=0) < 0 or lengths_B.max(initial=0) > T:
    raise ValueError(f"lengths must be [B={B}] integers in [0, T={T}], got {lengths_B.tolist()}")
  for name, ids in (("tokens", tokens_BT), ("targets", targets_BT)):
    real = ids[np.arange(T)[None, :] < lengths_B[:, None]]
    if real.size and (real.min() < 0 or real.max() >= lm.vocab_size):
      raise ValueError(f"{name} hold ids outside the vocabulary [0, {lm.vocab_size})")
  longest = int(lengths_B.max(initial=0))
  nll_BT = np.zeros((B, T), np.float32)
  argmax_BT = np.full((B, T), -1, np.int32)
  if longest == 0:
    return Scores(nll_BT, argmax_BT)
  P = piece_length(lm, longest, piece)
  width = -(-longest // P) * P
  pad = lambda x: np.pad(x[:, :longest], ((0, 0), (0, width - longest)))
  tokens, targets = pad(tokens_BT), pad(targets_BT)
  cache = init_cache(lm.model.cfg, B, bucket(width))
  program = _program(lm.model)
  for start in range(0, width, P):
    lengths = np.clip(lengths_B - start, 0, P).astype(np.int32)
    cache, nll, top = program(lm.variables, cache, jnp.asarray(tokens[:, start:start + P]),
                              jnp.asarray(targets[:, start:start + P]), jnp.asarray(lengths))
    end = min(start + P, T)
    nll_BT[:, start:end] = np.asarray(nll)[:, :end - start]
    argmax_BT[:, start:end] = np.asarray(top)[:, :end - start]
  real_BT = np.arange(T)[None, :] < lengths_B[:, None]
  return Scores(np.where(real_BT, nll_BT, 0.0), np.where(real_BT, argmax_BT, -1))
