"""Sigmoid router: top-k selection on biased scores, mixture weights from unbiased ones (docs/design.md §5).

All functions act on one shard of tokens; under shard_map the caller reduces the returned sums.
"""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moejax.config import ROUTER_MATMULS
from moejax.nn import MATMUL_NAME, same_varying_axes


def router_scores(x_MD, w_DE, matmul: str = "f32"):
  """s = sigmoid(x W_r), in float32 whatever the compute dtype: the top-k is sensitive to rounding.

  matmul: "f32", one float32 matmul at Precision.HIGHEST (on the GPU, CUDA cores, slow for the FLOPs:
  BENCHMARKS.md, "Training step profile"); "bf16x3", the same products on bf16 tensor cores
  (`logits_bf16x3`: float32 W as three exact bf16 parts, bf16 x only); "auto", bf16x3 for bf16 x and f32
  otherwise (a step of experiments/h200.py on the H200 was slightly faster with bf16x3)."""
  if matmul == "auto":
    matmul = "bf16x3" if x_MD.dtype == jnp.bfloat16 else "f32"
  if matmul == "f32":
    logits_ME = jnp.dot(x_MD.astype(jnp.float32), w_DE.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
  elif matmul == "bf16x3":
    # Inside shard_map the replicated weight is marked as varying like the tokens, so that the custom
    # VJP's weight gradient matches it and the cast's transpose sums it over the shards.
    # Named like nn.matmul's dots, so that remat policies that save dots (model.DOTS_POLICY) keep it.
    logits_ME = checkpoint_name(logits_bf16x3(*same_varying_axes(x_MD, w_DE)), MATMUL_NAME)
  else:
    raise ValueError(f"router matmul {matmul!r} not in {ROUTER_MATMULS}")
  return jax.nn.sigmoid(logits_ME)


def _bf16_parts(x, n: int):
  """n bf16 arrays whose sum is float32 x: exactly for n = 3 (8 + 8 + 8 significant bits) where |x| is
  between about 2^-102 (below, the last parts underflow) and 3.39e38 (above, the first rounds to inf);
  n = 2 leaves a relative error below 2^-16. Each part is rounded by reduce_precision, which XLA keeps:
  a float32 -> bf16 -> float32 round trip is one that XLA:GPU removes under its default excess
  precision (SimplifyFPConversions), which would leave the later parts zero. (The KDA kernels split
  their float32 gates the same way with plain casts, pallas_kernels.kda.tiles._bf16_parts: inside a
  Pallas kernel no XLA pass runs.)"""
  parts, rest = [], x.astype(jnp.float32)
  for _ in range(n):
    part = jax.lax.reduce_precision(rest, exponent_bits=8, mantissa_bits=7)
    parts.append(part.astype(jnp.bfloat16))
    rest = rest - part
  return parts


def _column_blocks_sum(y, n: int):
  """[..., n E] -> [..., E]: the sum of its n column blocks."""
  E = y.shape[-1] // n
  return sum(y[..., i * E:(i + 1) * E] for i in range(n))


@jax.custom_vjp
def logits_bf16x3(x_MD, w_DE):
  """x W [M, E] float32 for bf16 x and float32 W, on bf16 tensor cores: W split into three bf16 parts
  whose sum is W exactly, side by side in one [D, 3E] operand, so that one matmul makes x W_hi, x W_mid
  and x W_lo. Each product of a bf16 pair is exact in float32, and the sums are float32, as in a
  float32 matmul at HIGHEST: comparable precision (tensor cores align their float32 sums by truncation),
  summed in another order. For |W| up to about 3.39e38 (`_bf16_parts`); reverse-mode only (a custom
  VJP: jax.jvp and jacfwd raise).

  Backward: dW = x^T dlogits likewise exact (dlogits in three parts); dx = dlogits W^T from two parts of
  each (hi hi + hi lo + lo hi, relative error about 2^-16), as dx is rounded to bf16 anyway."""
  if x_MD.dtype != jnp.bfloat16:
    raise ValueError(f"logits_bf16x3 takes bf16 activations (only W is split, so x must be bf16 already), "
                     f"got {x_MD.dtype}")
  w3 = jnp.concatenate(_bf16_parts(w_DE, 3), axis=1)
  return _column_blocks_sum(jnp.dot(x_MD, w3, preferred_element_type=jnp.float32), 3)


def _logits_fwd(x_MD, w_DE):
  return logits_bf16x3(x_MD, w_DE), (x_MD, w_DE)


def _logits_bwd(res, dl_ME):
  x_MD, w_DE = res
  dl_hi, dl_lo = _bf16_parts(dl_ME, 2)
  w_hi, w_lo = _bf16_parts(w_DE, 2)
  # dx comes out of the matmul in x's dtype (its float32 sums rounded once, as a cast after would): a
  # float32 [M, D] output would be written and read again only to be cast.
  dx = jnp.dot(jnp.concatenate([dl_hi, dl_hi, dl_lo], axis=1),
               jnp.concatenate([w_hi, w_lo, w_hi], axis=1).T, preferred_element_type=x_MD.dtype)
  dw = jnp.dot(x_MD.T, jnp.concatenate(_bf16_parts(dl_ME, 3), axis=1), preferred_element_type=jnp.float32)
  return dx, _column_blocks_sum(dw, 3).astype(w_DE.dtype)


logits_bf16x3.defvjp(_logits_fwd, _logits_bwd)


def select_experts(s_ME, bias_E, k: int, scaling: float, forced_MK=None):
  """Top-k of s + bias; weights are the chosen unbiased scores, normalised over k, times `scaling`.

  The bias only moves the selection: it gets no gradient. forced_MK [M, k]: experts that a token takes
  instead (routing replay, moejax/moe/replay.py); a token whose entries are -1 chooses its own.
  """
  _, idx_MK = jax.lax.top_k(s_ME + jax.lax.stop_gradient(bias_E), k)
  if forced_MK is not None:
    if forced_MK.shape != idx_MK.shape:
      raise ValueError(f"forced experts {forced_MK.shape} do not match the tokens' top-k {idx_MK.shape}")
    idx_MK = jnp.where(forced_MK[:, :1] >= 0, forced_MK.astype(idx_MK.dtype), idx_MK)
  s_MK = jnp.take_along_axis(s_ME, idx_MK, axis=1)
  p_MK = s_MK / jnp.sum(s_MK, axis=1, keepdims=True) * scaling
  return idx_MK.astype(jnp.int32), p_MK


def expert_load(idx_MK, num_experts: int):
  """Tokens routed to each expert, float32 [E]."""
  return jnp.bincount(idx_MK.reshape(-1), length=num_experts).astype(jnp.float32)


def sequence_aux_loss_terms(s_ME, idx_MK, doc_BT, k: int):
  """Sequence-wise balance loss (DeepSeek-V3), summed over documents, and the document count.

  Per document of T' tokens: f_j = n/(k T') * #{tokens choosing j}, P_j = mean over tokens of
  s_tj / sum_l s_tl, loss = sum_j f_j P_j (1 when perfectly balanced). doc_BT: the row-local
  document ids (`moejax.layers.packing.Packing`). The caller divides the sum by the count (after
  reducing both over shards) and applies the weight.
  """
  b, t = doc_BT.shape
  m, n = s_ME.shape
  doc_M = (jnp.arange(b, dtype=jnp.int32)[:, None] * t + doc_BT).reshape(m)
  chosen_ME = jnp.zeros((m, n), jnp.float32).at[jnp.arange(m)[:, None], idx_MK].set(1.0)
  share_ME = s_ME / jnp.sum(s_ME, axis=1, keepdims=True)
  seg_sum = lambda a: jax.ops.segment_sum(a, doc_M, num_segments=m)
  chosen_GE, share_GE = seg_sum(chosen_ME), seg_sum(share_ME)
  tokens_G = seg_sum(jnp.ones((m,), jnp.float32))
  per_doc_G = (n / k) * jnp.sum(chosen_GE * share_GE, axis=1) / jnp.maximum(tokens_G, 1.0) ** 2
  return jnp.sum(per_doc_G), jnp.sum(tokens_G > 0).astype(jnp.float32)
