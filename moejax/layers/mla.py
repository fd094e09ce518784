"""Gated multi-head latent attention without positional encoding (docs/design.md §3).

Queries and keys/values go through low-rank latents (q_lora, kv_lora), each RMS-normalised, then
per-head up-projections. There is no RoPE: position information comes from the KDA layers. An
elementwise sigmoid gate of the layer input multiplies the attention output before W_o.

Training runs the whole row through one fused attention (`model.mla.attention`, see
`GatedMLA.implementation`). Decoding (`GatedMLA.decode`)
caches only the normalised kv latent and folds W_uk into the query and W_uv into the output, so the
cache costs kv_lora numbers per token instead of heads * (qk + v).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from moejax.config import MLA_ATTENTIONS
from moejax.layers.packing import document_ids_of
from moejax.nn import RMSNorm, check_input, kernel_init, logical_param, matmul
from pallas_kernels.attention import document_attention


def init_mla_cache(cfg: ml_collections.FrozenConfigDict, batch: int, max_len: int):
  """Empty decode cache: the normalised kv latent of every position, and the next write index."""
  return {"latent": jnp.zeros((batch, max_len, cfg.mla.kv_lora_rank), jnp.dtype(cfg.dtype)),
          "index": jnp.zeros((), jnp.int32)}


def max_logits(q_BTHK, k_BTHK, doc_BT, scale: float, chunk: int = 512):
  """Per-head max pre-softmax logit over causal same-document pairs, float32 [H], no gradient.

  For QK-clip where the attention cannot report it (cuDNN, XLA): one extra QK^T pass, over
  [chunk, chunk] blocks so that its memory stays [B,H,chunk,chunk] at any length. The Pallas
  kernels return it from their forward pass instead (`document_attention(return_max_logit=True)`).
  """
  q_BTHK, k_BTHK = jax.lax.stop_gradient(q_BTHK), jax.lax.stop_gradient(k_BTHK)
  B, T, H, _ = q_BTHK.shape
  chunk = min(chunk, T)
  n = -(-T // chunk)
  pad = n * chunk - T
  blocks = lambda x, fill: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2),
                                   constant_values=fill).reshape(B, n, chunk, *x.shape[2:]).swapaxes(0, 1)
  q_NBCHK, k_NBCHK = blocks(q_BTHK, 0), blocks(k_BTHK, 0)
  doc_NBC = blocks(doc_BT, -1)  # padded keys match no real query's document
  pos_NC = jnp.arange(n * chunk).reshape(n, chunk)

  def query_block(i):
    def key_block(j, running_H):
      logits_BHCS = jnp.einsum("bchk,bshk->bhcs", q_NBCHK[i], k_NBCHK[j],
                               preferred_element_type=jnp.float32) * scale
      ok_BCS = ((doc_NBC[i][:, :, None] == doc_NBC[j][:, None, :])
                & (pos_NC[j][None, None, :] <= pos_NC[i][None, :, None])
                & (pos_NC[i][None, :, None] < T))  # padded rows would see padded keys, logit 0
      block_H = jnp.max(jnp.where(ok_BCS[:, None], logits_BHCS, -jnp.inf), axis=(0, 2, 3))
      return jnp.maximum(running_H, block_H)

    return jax.lax.fori_loop(0, i + 1, key_block, jnp.full((H,), -jnp.inf, jnp.float32))

  return jnp.max(jax.lax.map(query_block, jnp.arange(n)), axis=0)


class GatedMLA(nn.Module):
  """y = W_o( sigmoid(W_g x) * Attention_causal,per-document(q, k, v) ), NoPE.

  `attention_impl` overrides `cfg.mla.attention` when given; see `implementation` for "auto".
  """

  cfg: ml_collections.FrozenConfigDict
  attention_impl: str | None = None

  def setup(self):
    c, a = self.cfg, self.cfg.mla
    D, H, Q, C = c.d_model, a.num_heads, a.q_lora_rank, a.kv_lora_rank
    K, V = a.qk_nope_head_dim, a.v_head_dim
    if self.attention_impl not in (None, *MLA_ATTENTIONS):
      raise ValueError(f"GatedMLA.attention_impl={self.attention_impl!r} not in "
                       f"{(None, *MLA_ATTENTIONS)}")
    pdt = jnp.dtype(c.param_dtype)

    def param(name, shape, axes, num_in_axes=1):
      return logical_param(self, name, kernel_init(num_in_axes, len(shape)), shape, axes, pdt)

    self.w_dq = param("w_dq", (D, Q), ("embed", "q_lora"))
    self.w_uq = param("w_uq", (Q, H, K), ("q_lora", "heads", "kv"))
    self.w_dkv = param("w_dkv", (D, C), ("embed", "kv_lora"))
    self.w_uk = param("w_uk", (C, H, K), ("kv_lora", "heads", "kv"))
    self.w_uv = param("w_uv", (C, H, V), ("kv_lora", "heads", "kv"))
    self.w_g = param("w_g", (D, H, V), ("embed", "heads", "kv"))
    self.w_o = param("w_o", (H, V, D), ("heads", "kv", "embed"), num_in_axes=2)
    norm = lambda: RMSNorm(eps=c.norm_eps, dtype=self.dtype, param_dtype=pdt)
    self.q_norm = norm()
    self.kv_norm = norm()

  @property
  def dtype(self):
    return jnp.dtype(self.cfg.dtype)

  def queries(self, x_BTD):
    """[B,T,H,K] queries through the normalised q latent."""
    cq_BTQ = self.q_norm(matmul("btd,dq->btq", x_BTD, self.w_dq, self.dtype))
    return matmul("btq,qhk->bthk", cq_BTQ, self.w_uq, self.dtype)

  def kv_latent(self, x_BTD):
    """[B,T,C] normalised kv latent: the only per-token state decoding keeps."""
    return self.kv_norm(matmul("btd,dc->btc", x_BTD, self.w_dkv, self.dtype))

  def gated_output(self, x_BTD, o_BTHV):
    gate_BTHV = jax.nn.sigmoid(matmul("btd,dhv->bthv", x_BTD, self.w_g, self.dtype).astype(jnp.float32))
    return matmul("bthv,hvd->btd", (gate_BTHV * o_BTHV.astype(jnp.float32)).astype(self.dtype),
                  self.w_o, self.dtype)

  def implementation(self, packed: bool) -> str:
    """"auto": on GPU in 16-bit, the Pallas document-attention kernels (pallas_kernels.attention) for
    packed rows and cuDNN for rows of one document; XLA otherwise (jax 0.11.2's own
    `implementation=None` also means XLA, which materialises the float32 [B,H,T,T] logits; cuDNN
    rejects float32 inputs). cuDNN takes documents only as a dense [T, T] mask (2 GB per row at
    32K) and still visits every causal tile: at B=4 T=8192 with documents of mean length 2048 our
    kernels ran 2.1x (forward) and 2.9x (forward + backward) faster on the H200 (BENCHMARKS.md,
    "Document attention")."""
    choice = self.attention_impl or self.cfg.mla.attention
    if choice != "auto":
      return choice
    half = self.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if not half or jax.default_backend() != "gpu":
      return "xla"
    return "pallas" if packed else "cudnn"

  def attention(self, q_BTHK, k_BTHK, v_BTHV, doc_BT, scale: float, max_logit: bool = False):
    """Causal attention within documents (doc_BT None: one document per row). [B,T,H,V], and with
    max_logit also the per-head max logit [H] (float32, no gradient) for QK-clip."""
    impl = self.implementation(doc_BT is not None)
    if impl in ("pallas", "interpret"):
      return document_attention(q_BTHK, k_BTHK, v_BTHV, doc_BT, scale=scale, implementation=impl,
                                return_max_logit=max_logit)
    # cuDNN wants keys and values of one width; zero columns change neither the logits (q.k) nor the
    # kept output columns, and the scale is passed explicitly.
    V, width = v_BTHV.shape[-1], max(q_BTHK.shape[-1], v_BTHV.shape[-1])
    pad = lambda t: jnp.pad(t, ((0, 0), (0, 0), (0, 0), (0, width - t.shape[-1])))
    q_BTHW, k_BTHW, v_BTHW = pad(q_BTHK), pad(k_BTHK), pad(v_BTHV)
    # Packed documents go to cuDNN/XLA as a boolean [B,1,T,T] mask next to is_causal=True: it is the
    # one per-document form both take (query/key_value_seq_lengths describe one padded sequence per
    # row, and cuDNN's packed-segment offsets are not reachable through this API). cuDNN turns it
    # into an additive bias and still skips the upper triangle. Every query sees itself, so no row
    # is fully masked. Checked on the H200 (bf16, T=1024, 3 documents): cuDNN matches XLA.
    mask_B1TT = None if doc_BT is None else doc_BT[:, None, :, None] == doc_BT[:, None, None, :]
    o_BTHV = jax.nn.dot_product_attention(q_BTHW, k_BTHW, v_BTHW, mask=mask_B1TT, scale=scale,
                                          is_causal=True, implementation=impl)[..., :V]
    if not max_logit:
      return o_BTHV
    B, T = q_BTHK.shape[:2]
    return o_BTHV, max_logits(q_BTHK, k_BTHK, jnp.zeros((B, T), jnp.int32) if doc_BT is None else doc_BT,
                              scale)

  def __call__(self, x_BTD, packing=None, cache=None):
    """(y_BTD, cache). packing: a `moejax.layers.packing.Packing`, segment ids, or None (one document a
    row). cache: None (the whole row at once; None comes back), or a decode cache (`init_mla_cache`)
    that the row's S tokens of one document are appended to (`decode`)."""
    check_input(x_BTD, self.cfg.d_model, "GatedMLA")
    B, T, _ = x_BTD.shape
    doc_BT = document_ids_of(packing, B, T)
    if cache is not None:
      if doc_BT is not None:
        raise ValueError("GatedMLA: a decode cache holds one document a row; call it without packing")
      return self.decode(x_BTD, cache)
    x_BTD = x_BTD.astype(self.dtype)
    q_BTHK = self.queries(x_BTD)
    c_BTC = self.kv_latent(x_BTD)
    k_BTHK = matmul("btc,chk->bthk", c_BTC, self.w_uk, self.dtype)
    v_BTHV = matmul("btc,chv->bthv", c_BTC, self.w_uv, self.dtype)

    K = q_BTHK.shape[-1]
    if self.is_mutable_collection("attn_stats"):  # asked for by QK-clip only
      o_BTHV, max_H = self.attention(q_BTHK, k_BTHK, v_BTHV, doc_BT, K ** -0.5, max_logit=True)
      self.sow("attn_stats", "max_logit", max_H)
    else:
      o_BTHV = self.attention(q_BTHK, k_BTHK, v_BTHV, doc_BT, K ** -0.5)
    return self.gated_output(x_BTD, o_BTHV), None

  def decode(self, x_BSD, cache):
    """Appends S tokens (S >= 1) of one document per row to `cache`; returns (y_BSD, new cache).

    Writing past the cache's length raises where `index` is concrete; under jit, where it is traced,
    the outputs of such a call are NaN instead (the write itself cannot be stopped there).

    Scores are q^T W_uk^T c = (W_uk q)^T c and outputs W_uv^T (sum_j p_j c_j), so attention runs
    in the kv_lora space as multi-query attention with a single latent head for keys and values.
    """
    check_input(x_BSD, self.cfg.d_model, "GatedMLA.decode")
    latent_BLC, index = cache["latent"], cache["index"]
    S, L = x_BSD.shape[1], latent_BLC.shape[1]
    if latent_BLC.shape != (x_BSD.shape[0], L, self.cfg.mla.kv_lora_rank):
      raise ValueError(f"GatedMLA.decode: cache latent shape {latent_BLC.shape} does not match "
                       f"batch {x_BSD.shape[0]} and kv_lora_rank {self.cfg.mla.kv_lora_rank}")
    if not isinstance(index, jax.core.Tracer) and int(index) + S > L:
      raise ValueError(f"GatedMLA.decode: writing {S} tokens at index {int(index)} overflows the "
                       f"cache of length {L}")
    x_BSD = x_BSD.astype(self.dtype)
    c_BSC = self.kv_latent(x_BSD)
    latent_BLC = jax.lax.dynamic_update_slice(latent_BLC, c_BSC.astype(latent_BLC.dtype),
                                              (0, index, 0))
    q_BSHK = self.queries(x_BSD)
    qc_BSHC = matmul("bshk,chk->bshc", q_BSHK, self.w_uk, self.dtype)
    kv_BL1C = latent_BLC.astype(self.dtype)[:, :, None, :]
    pos_S = index + jnp.arange(S, dtype=jnp.int32)
    mask_11SL = (jnp.arange(L, dtype=jnp.int32)[None, :] <= pos_S[:, None])[None, None]
    # XLA: with one query token per step the work is a memory-bound read of the cache, and cuDNN
    # would need seqlens/bias plumbing for the partly filled cache.
    oc_BSHC = jax.nn.dot_product_attention(qc_BSHC, kv_BL1C, kv_BL1C, mask=mask_11SL,
                                           scale=self.cfg.mla.qk_nope_head_dim ** -0.5,
                                           implementation="xla")
    o_BSHV = matmul("bshc,chv->bshv", oc_BSHC, self.w_uv, self.dtype)
    y_BSD = self.gated_output(x_BSD, o_BSHV)
    if isinstance(index, jax.core.Tracer):
      y_BSD = jnp.where(index + S > L, jnp.nan, y_BSD)
    return y_BSD, {"latent": latent_BLC, "index": index + S}
