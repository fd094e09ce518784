"""Block Attention Residuals (docs/design.md §4).

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
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from moejax.nn import logical_param


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
    if stacked is not None and valid_N is None:
      valid_N = jnp.ones((stacked.shape[0],), bool)
    return attnres_mix(w_D, tuple(sources), stacked, valid_N, self.eps)


def _scores(w_D, v, eps):
  """(1/rms(v), v.w) per row of v [..., D], float32. Keys are normalised so that a source's scale does
  not buy it attention; values are not, so the mixture keeps the magnitudes the sublayers produced."""
  v32 = v.astype(jnp.float32)
  r = jax.lax.rsqrt(jnp.mean(v32 * v32, axis=-1) + eps)
  return r, jnp.einsum("...d,d->...", v32, w_D.astype(jnp.float32), precision="highest")


def _check_shapes(w_D, sources, stacked, valid_N):
  """The parts are told apart by rank below (4: the stacked slots), so the ranks must be exact."""
  shape = sources[0].shape if sources else None if stacked is None else stacked.shape[1:]
  if shape is None or len(shape) != 3 or any(v.shape != shape for v in sources):
    raise ValueError(f"AttnRes sources must share one [B,T,D] shape, got {[v.shape for v in sources]}")
  if stacked is not None and (stacked.shape[1:] != shape or valid_N is None
                              or valid_N.shape != stacked.shape[:1]):
    raise ValueError(f"AttnRes stacked slots must be [N,B,T,D] over [B,T,D]={shape} with a [N] mask, got "
                     f"{stacked.shape} and {None if valid_N is None else valid_N.shape}")
  if w_D.shape != shape[-1:]:
    raise ValueError(f"AttnRes query must be [{shape[-1]}], got {w_D.shape}")


def _parts(sources, stacked):
  """The stacked slots (one [N,B,T,D] part) first, then each [B,T,D] source: the softmax's order."""
  return ([] if stacked is None else [stacked]) + list(sources)


def _mix_forward(w_D, sources, stacked, valid_N, eps):
  _check_shapes(w_D, sources, stacked, valid_N)
  parts = _parts(sources, stacked)
  r_vw = [_scores(w_D, v, eps) for v in parts]
  logits = [vw * r if v.ndim == 4 else (vw * r)[None] for v, (r, vw) in zip(parts, r_vw, strict=True)]
  if stacked is not None:
    logits[0] = jnp.where(valid_N[:, None, None], logits[0], -jnp.inf)
  a_SBT = jax.nn.softmax(jnp.concatenate(logits), axis=0)
  a_parts = _split(a_SBT, parts)
  h_BTD = sum(_weighted(a, v) for a, v in zip(a_parts, parts, strict=True))
  return h_BTD.astype(jnp.result_type(*parts)), (w_D, sources, stacked, valid_N, a_SBT, r_vw)


def _split(x_S, parts):
  """x [S, ...] cut into one piece per part: [N, ...] for the stacked part, [...] for each source."""
  out, i = [], 0
  for v in parts:
    n = v.shape[0] if v.ndim == 4 else None
    out.append(x_S[i:i + n] if n is not None else x_S[i])
    i += n or 1
  return out


def _weighted(a, v):
  """sum over the leading stacked axis, if any, of a[..., None] * v, float32."""
  prod = a[..., None] * v.astype(jnp.float32)
  return prod.sum(axis=0) if v.ndim == 4 else prod


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attnres_mix(w_D, sources: tuple, stacked, valid_N, eps: float):
  """h = sum_i a_i v_i, a = softmax_i(w . RMSNorm(v_i)), [B,T,D] in the sources' dtype (summed in
  float32), over the [B,T,D] `sources` and the [N,B,T,D] `stacked` slots where `valid_N` (stacked slots
  come first in the softmax).

  The backward pass keeps only the sources as given (bfloat16 in a bf16 model) and per-row scalars
  (the weights a, 1/rms and v.w): autodiff of the same formula kept float32 copies of every source
  for both the key norm and the weighted sum, which at T=1M were 4 GiB per source and layer. The
  output is rounded here rather than by the caller so that its cotangent arrives in the sources'
  dtype too: each source's gradient sums one term per later sublayer, and XLA builds those terms from
  the sublayers' cotangents, which it keeps until then (float32 ones doubled that traffic).
  """
  return _mix_forward(w_D, sources, stacked, valid_N, eps)[0]


def _mix_backward(eps, res, dh_BTD):
  w_D, sources, stacked, valid_N, a_SBT, r_vw = res
  parts = _parts(sources, stacked)
  dh = dh_BTD.astype(jnp.float32)
  w32 = w_D.astype(jnp.float32)
  d = w_D.shape[0]
  # da_i = v_i . dh, then the softmax's backward: dlogit_i = a_i (da_i - sum_j a_j da_j).
  da = [jnp.sum(v.astype(jnp.float32) * dh, axis=-1) for v in parts]
  da_SBT = jnp.concatenate([x if v.ndim == 4 else x[None] for x, v in zip(da, parts, strict=True)])
  dlogit_SBT = a_SBT * (da_SBT - jnp.sum(a_SBT * da_SBT, axis=0, keepdims=True))
  dvs, dlogit_r = [], []
  for v, a, dl, (r, vw) in zip(parts, _split(a_SBT, parts), _split(dlogit_SBT, parts), r_vw, strict=True):
    v32 = v.astype(jnp.float32)
    # logit = (v.w) r with r = (mean(v^2) + eps)^(-1/2): dlogit/dv = r w - (v.w) r^3 v / D.
    dv = a[..., None] * dh + dl[..., None] * (r[..., None] * w32 - (vw * r ** 3 / d)[..., None] * v32)
    dvs.append(dv.astype(v.dtype))
    dlogit_r.append(dl * r)
  # dw = sum over tokens of dlogit r v. Left to itself, XLA:GPU fused that column reduction with the
  # sources' gradients (and their sums over later sublayers) into kernels tiled for the reduction, each
  # many times slower than the reduction alone in the H200 step (BENCHMARKS.md, "Training step
  # profile"). Behind the barrier it is a pass of its own over the sources.
  dlogit_r, parts = jax.lax.optimization_barrier((dlogit_r, parts))
  dw = sum(jnp.einsum("...,...d->d", c, v.astype(jnp.float32), precision="highest")
           for c, v in zip(dlogit_r, parts, strict=True))
  d_stacked = dvs.pop(0) if stacked is not None else None
  return dw.astype(w_D.dtype), tuple(dvs), d_stacked, None


attnres_mix.defvjp(_mix_forward, _mix_backward)


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
