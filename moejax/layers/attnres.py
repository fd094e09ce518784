"""Block Attention Residuals (DESIGN §4).

Each sublayer reads a softmax mixture of earlier representations instead of a running sum:

    h = sum_i a_i v_i,   a = softmax_i(w^T RMSNorm(v_i))

with one zero-initialised pseudo-query w per sublayer, so training starts from the uniform average.
Sources are the token embedding, the sum of each completed block and the running partial sum of the
current block, which keeps memory at O(blocks * d) per token instead of O(sublayers * d).

Two carriers of that state: `ResidualState` keeps the blocks as a Python list (layers unrolled), and
`StackedResidualState` keeps them in one [N,B,T,D] buffer with a count of the filled slots, so that the
state has the same structure after every period of a scan over layers (moejax/model.py).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.nn import logical_param, rms_norm


class AttnResQuery(nn.Module):
  """One pseudo-query: mixes [B,T,D] sources into one [B,T,D] input.

  sources: a list of [B,T,D] arrays, and optionally `stacked` [N,B,T,D] more of them of which only
  those with `valid_N` take part (empty slots of a StackedResidualState).
  """

  eps: float = 1e-6

  @nn.compact
  def __call__(self, sources: list[jax.Array], stacked: jax.Array | None = None,
               valid_N: jax.Array | None = None) -> jax.Array:
    if not sources and stacked is None:
      raise ValueError("AttnResQuery needs at least one source")
    first = sources[0] if sources else stacked[0]
    w_D = logical_param(self, "query", nn.initializers.zeros, (first.shape[-1],), ("embed",))
    # Keys are normalised so that a source's scale does not buy it attention; values are not, so the
    # mixture keeps the magnitudes the sublayers produced.
    score = lambda v: jnp.einsum("...d,d->...", rms_norm(v, eps=self.eps), w_D)
    logits = [score(v)[None] for v in sources]
    if stacked is not None:
      logits_NBT = score(stacked)
      if valid_N is not None:
        logits_NBT = jnp.where(valid_N[:, None, None], logits_NBT, -jnp.inf)
      logits.insert(0, logits_NBT)
    a_SBT = jax.nn.softmax(jnp.concatenate(logits), axis=0)
    n = 0 if stacked is None else stacked.shape[0]
    h_BTD = sum((a_SBT[n + i][..., None] * v.astype(jnp.float32) for i, v in enumerate(sources)),
                jnp.zeros(first.shape, jnp.float32))
    if stacked is not None:
      h_BTD = h_BTD + jnp.einsum("nbt,nbtd->btd", a_SBT[:n], stacked.astype(jnp.float32))
    return h_BTD.astype(first.dtype)


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

  def mix(self, query: AttnResQuery) -> jax.Array:
    return query(self.sources())

  def add(self, out_BTD, block_size: int) -> "ResidualState":
    partial = out_BTD if self.partial is None else self.partial + out_BTD
    if self.filled + 1 == block_size:
      return ResidualState(self.blocks + [partial], None, 0)
    return ResidualState(self.blocks, partial, self.filled + 1)

  def residual_sum(self) -> jax.Array:
    """The plain residual stream: embedding plus every sublayer output so far."""
    return sum(self.sources()[1:], self.blocks[0])

  def stacked(self, num_slots: int) -> "StackedResidualState":
    """The same state with its blocks in a buffer of num_slots (>= len(blocks)), at a block boundary."""
    if self.partial is not None or self.filled:
      raise ValueError("a ResidualState can be stacked only at a block boundary")
    if num_slots < len(self.blocks):
      raise ValueError(f"{num_slots} slots cannot hold {len(self.blocks)} blocks")
    empty = [jnp.zeros_like(self.blocks[0])] * (num_slots - len(self.blocks))
    return StackedResidualState(jnp.stack(self.blocks + empty), jnp.int32(len(self.blocks)), None, 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StackedResidualState:
  """ResidualState with the blocks in one buffer: blocks_NBTD holds num_blocks (traced) filled slots."""

  blocks_NBTD: jax.Array
  num_blocks: jax.Array
  partial: jax.Array | None
  filled: int = dataclasses.field(metadata=dict(static=True), default=0)

  def mix(self, query: AttnResQuery) -> jax.Array:
    valid_N = jnp.arange(self.blocks_NBTD.shape[0]) < self.num_blocks
    return query([self.partial] if self.partial is not None else [], self.blocks_NBTD, valid_N)

  def add(self, out_BTD, block_size: int) -> "StackedResidualState":
    partial = out_BTD if self.partial is None else self.partial + out_BTD
    if self.filled + 1 == block_size:
      blocks = jax.lax.dynamic_update_index_in_dim(self.blocks_NBTD, partial.astype(self.blocks_NBTD.dtype),
                                                   self.num_blocks, 0)
      return StackedResidualState(blocks, self.num_blocks + 1, None, 0)
    return StackedResidualState(self.blocks_NBTD, self.num_blocks, partial, self.filled + 1)

  def unstacked(self, num_blocks: int) -> ResidualState:
    """Back to a list, given the (static) number of filled slots."""
    if self.partial is not None or self.filled:
      raise ValueError("a StackedResidualState can be unstacked only at a block boundary")
    return ResidualState([self.blocks_NBTD[i] for i in range(num_blocks)], None, 0)
