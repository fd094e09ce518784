"""The next token from a row's logits: greedy, or drawn after temperature, top-k and top-p.

The order is the field's usual one: the logits are divided by the temperature, cut to the k largest,
then to the smallest set of largest whose probability reaches p, and the token is drawn from what is
left, renormalised. The log-probability reported for a token is that of the model's own distribution,
log_softmax(logits), before any of these: what an RL importance ratio needs.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Sampling(NamedTuple):
  """How tokens are chosen. temperature 0 is greedy (top_k and top_p then play no part)."""

  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def checked(self, vocab_size: int) -> "Sampling":
    """This, validated; raises ValueError naming the bad argument."""
    t, k, p = self
    if not (isinstance(t, (int, float)) and t >= 0.0 and t == t and t != float("inf")):
      raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}")
    if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= vocab_size):
      raise ValueError(f"top_k must be None or an integer in [1, vocab size {vocab_size}], got {k!r}")
    if p is not None and not (isinstance(p, (int, float)) and 0.0 < p <= 1.0):
      raise ValueError(f"top_p must be None or a number in (0, 1], got {p!r}")
    return Sampling(float(t), k, None if p is None else float(p))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def filtered_logits(logits_BV, sampling: Sampling):
  """The logits that tokens are drawn from (float32 [B,V]): tempered, and -inf outside the top-k and
  top-p sets. Ties at either cut are all kept."""
  t, k, p = sampling
  x_BV = logits_BV.astype(jnp.float32) / t
  if k is not None and k < x_BV.shape[-1]:
    kth_B1 = jax.lax.top_k(x_BV, k)[0][:, -1:]
    x_BV = jnp.where(x_BV >= kth_B1, x_BV, -jnp.inf)
  if p is not None and p < 1.0:
    sorted_BV = jnp.sort(x_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # A token is kept while the mass of the tokens above it is still short of p: the first always is.
    keep_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV < p
    cut_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    x_BV = jnp.where(x_BV >= cut_B1, x_BV, -jnp.inf)
  return x_BV


def sample(logits_BV, keys_B, sampling: Sampling):
  """(tokens int32 [B], their log-probabilities float32 [B] under log_softmax(logits_BV)). keys_B: one
  PRNG key per row (unused when greedy)."""
  logits_BV = logits_BV.astype(jnp.float32)
  if sampling.greedy:
    tokens_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  else:
    x_BV = filtered_logits(logits_BV, sampling)
    tokens_B = jax.vmap(jax.random.categorical)(keys_B, x_BV).astype(jnp.int32)
  logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
  return tokens_B, jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]
