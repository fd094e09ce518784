"""Block Attention Residuals (DESIGN §4).

Each sublayer reads a softmax mixture of earlier representations instead of a running sum:

    h = sum_i a_i v_i,   a = softmax_i(w^T RMSNorm(v_i))

with one zero-initialised pseudo-query w per sublayer, so training starts from the uniform average.
Sources are the token embedding, the sum of each completed block and the running partial sum of the
current block, which keeps memory at O(blocks * d) per token instead of O(sublayers * d).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.nn import logical_param, rms_norm


class AttnResQuery(nn.Module):
  """One pseudo-query: mixes a list of [B,T,D] sources into one [B,T,D] input."""

  eps: float = 1e-6

  @nn.compact
  def __call__(self, sources: list[jax.Array]) -> jax.Array:
    if not sources:
      raise ValueError("AttnResQuery needs at least one source")
    v_NBTD = jnp.stack(sources)
    w_D = logical_param(self, "query", nn.initializers.zeros, (v_NBTD.shape[-1],), ("embed",))
    # Keys are normalised so that a source's scale does not buy it attention; values are not, so the
    # mixture keeps the magnitudes the sublayers produced.
    logits_NBT = jnp.einsum("nbtd,d->nbt", rms_norm(v_NBTD, eps=self.eps), w_D)
    a_NBT = jax.nn.softmax(logits_NBT, axis=0)
    h_BTD = jnp.einsum("nbt,nbtd->btd", a_NBT, v_NBTD.astype(jnp.float32))
    return h_BTD.astype(v_NBTD.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ResidualState:
  """What the stack carries between sublayers.

  blocks: the embedding followed by the sum of each completed block.
  partial: the running sum of the current block's sublayer outputs (None right after a block closes).
  filled: how many sublayers the current block holds (static).
  """

  blocks: list[jax.Array]
  partial: jax.Array | None
  filled: int = dataclasses.field(metadata=dict(static=True), default=0)

  @classmethod
  def start(cls, embedding_BTD):
    return cls(blocks=[embedding_BTD], partial=None, filled=0)

  def sources(self) -> list[jax.Array]:
    return self.blocks + ([self.partial] if self.partial is not None else [])

  def add(self, out_BTD, block_size: int) -> "ResidualState":
    partial = out_BTD if self.partial is None else self.partial + out_BTD
    if self.filled + 1 == block_size:
      return ResidualState(self.blocks + [partial], None, 0)
    return ResidualState(self.blocks, partial, self.filled + 1)

  def residual_sum(self) -> jax.Array:
    """The plain residual stream: embedding plus every sublayer output so far."""
    return sum(self.sources()[1:], self.blocks[0])
