"""Gated multi-head latent attention without positional encoding (docs/design.md §3).

Queries and keys/values go through low-rank latents (q_lora, kv_lora), each RMS-normalised, then
per-head up-projections. There is no RoPE: position information comes from the KDA layers. An
elementwise sigmoid gate of the layer input multiplies the attention output before W_o.

For ablations, `model.mla.rope_head_dim` R > 0 adds rotary position dimensions in DeepSeek-V2's
decoupled form: each head's query gains R dimensions from the q latent, all heads share R key
dimensions projected from x, both rotated by the token's position within its document; the logits are
q_nope.k_nope + q_rope.k_rope over sqrt(K + R). The decode cache then holds the rotated shared key
beside the latent (kv_lora + R numbers a token).

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
from moejax.layers.packing import Appended, Packing, document_ids_of
from moejax.nn import RMSNorm, check_input, kernel_init, logical_param, matmul
from pallas_kernels.attention import document_attention


def init_mla_cache(cfg: ml_collections.FrozenConfigDict, batch: int, max_len: int):
  """Empty decode cache: room for the normalised kv latent of `max_len` positions per row, and how many
  of them each row has filled."""
  width = cfg.mla.kv_lora_rank + cfg.mla.rope_head_dim  # the latent, then the rotated shared key
  return {"latent": jnp.zeros((batch, max_len, width), jnp.dtype(cfg.dtype)),
          "length": jnp.zeros((batch,), jnp.int32)}


def rotate(x_BTHR, pos_BT, theta: float):
  """Rotary position embedding of the last axis (R even; its halves rotate as pairs), at positions
  pos_BT, in float32 and back to x's dtype. q at position i and k at j then meet through i - j alone."""
  R = x_BTHR.shape[-1]
  freq_F = theta ** (-jnp.arange(0, R, 2, dtype=jnp.float32) / R)
  angle_BTF = pos_BT.astype(jnp.float32)[..., None] * freq_F
  cos_BT1F, sin_BT1F = jnp.cos(angle_BTF)[:, :, None], jnp.sin(angle_BTF)[:, :, None]
  a_BTHF, b_BTHF = jnp.split(x_BTHR.astype(jnp.float32), 2, axis=-1)
  out = [a_BTHF * cos_BT1F - b_BTHF * sin_BT1F, a_BTHF * sin_BT1F + b_BTHF * cos_BT1F]
  return jnp.concatenate(out, axis=-1).astype(x_BTHR.dtype)


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


# Keys per block: at most this many, and few enough that a block's [B, H, S, block] float32 scores stay
# near 1 GiB.
_MAX_BLOCK, _SCORE_ELEMENTS = 16384, 1 << 28


def latent_attention(qc_BSHC, latent_BLC, pos_BS, scale: float):
  """Softmax attention of S queries per row over the cached latents, in the latent space (keys and
  values are both the latent, multi-query over the H heads): query s of row b sees the positions
  l <= pos_BS[b, s]. [B,S,H,C] in the latents' dtype.

  Over blocks of keys with a running max and sum (flash attention's recurrence, in XLA), and only as
  many blocks as the furthest query reaches: a decode step reads the filled part of the cache, not its
  whole length, and a long prefill piece never holds a [S, L] score matrix. The blocks tile the cache
  without padding it (a copy of the whole cache): the last one starts early enough to end at L, and
  its keys that the block before it covered are masked.
  """
  B, S, H, C = qc_BSHC.shape
  L = latent_BLC.shape[1]
  n = -(-L // max(1, min(_MAX_BLOCK, _SCORE_ELEMENTS // (B * H * S))))
  block = -(-L // n)
  q_BSHC = qc_BSHC.astype(latent_BLC.dtype)
  # bf16 x bf16 -> float32 dots, which XLA's CPU runtime lacks inside loops: there the operands are
  # widened first, the same products (exact in float32) and the same float32 sums.
  wide = jax.default_backend() == "cpu" and latent_BLC.dtype != jnp.float32
  widen = (lambda x: x.astype(jnp.float32)) if wide else (lambda x: x)
  dot = lambda spec, a, b: jnp.einsum(spec, widen(a), widen(b), preferred_element_type=jnp.float32)

  def one_block(j, carry):
    m_BHS, sum_BHS, acc_BSHC = carry
    start = jnp.minimum(j * block, L - block)
    kv_BKC = jax.lax.dynamic_slice_in_dim(latent_BLC, start, block, axis=1)
    s_BHSK = dot("bshc,bkc->bhsk", q_BSHC, kv_BKC) * scale
    key_K = start + jnp.arange(block, dtype=jnp.int32)
    visible_BSK = (key_K[None, None, :] >= j * block) & (key_K[None, None, :] <= pos_BS[:, :, None])
    s_BHSK = jnp.where(visible_BSK[:, None], s_BHSK, -jnp.inf)
    m_new_BHS = jnp.maximum(m_BHS, jnp.max(s_BHSK, axis=-1))
    p_BHSK = jnp.exp(s_BHSK - m_new_BHS[..., None])
    correction_BHS = jnp.exp(m_BHS - m_new_BHS)
    sum_BHS = sum_BHS * correction_BHS + jnp.sum(p_BHSK, axis=-1)
    pv_BSHC = dot("bhsk,bkc->bshc", p_BHSK.astype(kv_BKC.dtype), kv_BKC)
    acc_BSHC = acc_BSHC * jnp.swapaxes(correction_BHS, 1, 2)[..., None] + pv_BSHC
    return m_new_BHS, sum_BHS, acc_BSHC

  # Finite, not -inf: a block a query cannot see leaves its max where it was, and exp(m - m) stays 1.
  carry = (jnp.full((B, H, S), -1e30, jnp.float32), jnp.zeros((B, H, S), jnp.float32),
           jnp.zeros((B, S, H, C), jnp.float32))
  if n == 1:  # a decode step's usual case: no loop, whose trip count a GPU would read back every step
    _, sum_BHS, acc_BSHC = one_block(0, carry)
  else:
    reach = jnp.minimum(jnp.max(pos_BS) // block + 1, n)
    _, sum_BHS, acc_BSHC = jax.lax.fori_loop(0, reach, one_block, carry)
  return (acc_BSHC / jnp.swapaxes(sum_BHS, 1, 2)[..., None]).astype(latent_BLC.dtype)


class GatedMLA(nn.Module):
  """y = W_o( sigmoid(W_g x) * Attention_causal,per-document(q, k, v) ), NoPE (or with decoupled RoPE
  dimensions where model.mla.rope_head_dim > 0, for ablations).

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
    if a.rope_head_dim:
      self.w_qr = param("w_qr", (Q, H, a.rope_head_dim), ("q_lora", "heads", "kv"))
      self.w_kr = param("w_kr", (D, a.rope_head_dim), ("embed", "kv"))
    norm = lambda: RMSNorm(eps=c.norm_eps, dtype=self.dtype, param_dtype=pdt)
    self.q_norm = norm()
    self.kv_norm = norm()

  @property
  def dtype(self):
    return jnp.dtype(self.cfg.dtype)

  @property
  def rope(self) -> int:
    return self.cfg.mla.rope_head_dim

  @property
  def scale(self) -> float:
    return (self.cfg.mla.qk_nope_head_dim + self.rope) ** -0.5

  def queries(self, x_BTD, pos_BT=None):
    """[B,T,H,K] queries through the normalised q latent; with RoPE, [B,T,H,K+R]: the rotated
    dimensions after them (at positions pos_BT)."""
    cq_BTQ = self.q_norm(matmul("btd,dq->btq", x_BTD, self.w_dq, self.dtype))
    q_BTHK = matmul("btq,qhk->bthk", cq_BTQ, self.w_uq, self.dtype)
    if not self.rope:
      return q_BTHK
    qr_BTHR = rotate(matmul("btq,qhr->bthr", cq_BTQ, self.w_qr, self.dtype), pos_BT, self.cfg.mla.rope_theta)
    return jnp.concatenate([q_BTHK, qr_BTHR], axis=-1)

  def rope_key(self, x_BTD, pos_BT):
    """[B,T,R]: the shared rotated key dimensions of RoPE."""
    kr_BT1R = matmul("btd,dr->btr", x_BTD, self.w_kr, self.dtype)[:, :, None]
    return rotate(kr_BT1R, pos_BT, self.cfg.mla.rope_theta)[:, :, 0]

  def with_rope_key(self, k_BTHK, kr_BTR):
    """Per-head keys [B,T,H,K+R]: the shared rotated dimensions after each head's own."""
    kr_BTHR = jnp.broadcast_to(kr_BTR[:, :, None], (*k_BTHK.shape[:3], kr_BTR.shape[-1]))
    return jnp.concatenate([k_BTHK, kr_BTHR.astype(k_BTHK.dtype)], axis=-1)

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
    that the row's S tokens of one document are appended to (`decode`); then packing is None or an
    `Appended` (rows of fewer real tokens)."""
    check_input(x_BTD, self.cfg.d_model, "GatedMLA")
    B, T, _ = x_BTD.shape
    if cache is not None:
      if packing is not None and not isinstance(packing, Appended):
        raise ValueError("GatedMLA: a decode cache holds one document a row; call it without packing")
      return self.decode(x_BTD, cache, None if packing is None else packing.lengths_B)
    if isinstance(packing, Appended):
      raise ValueError("GatedMLA: tokens `Appended` to a cache need the cache")
    doc_BT = document_ids_of(packing, B, T)
    x_BTD = x_BTD.astype(self.dtype)
    pos_BT = None
    if self.rope:
      pos_BT = (jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if doc_BT is None
                else Packing(doc_BT).positions_BT())
    q_BTHK = self.queries(x_BTD, pos_BT)
    c_BTC = self.kv_latent(x_BTD)
    k_BTHK = matmul("btc,chk->bthk", c_BTC, self.w_uk, self.dtype)
    v_BTHV = matmul("btc,chv->bthv", c_BTC, self.w_uv, self.dtype)
    if self.rope:
      k_BTHK = self.with_rope_key(k_BTHK, self.rope_key(x_BTD, pos_BT))

    if self.is_mutable_collection("attn_stats"):  # asked for by QK-clip only
      o_BTHV, max_H = self.attention(q_BTHK, k_BTHK, v_BTHV, doc_BT, self.scale, max_logit=True)
      self.sow("attn_stats", "max_logit", max_H)
    else:
      o_BTHV = self.attention(q_BTHK, k_BTHK, v_BTHV, doc_BT, self.scale)
    return self.gated_output(x_BTD, o_BTHV), None

  def decode(self, x_BSD, cache, lengths_B=None):
    """Appends S tokens (S >= 1) of one document per row to `cache`; returns (y_BSD, new cache).
    lengths_B: row b's first lengths_B[b] tokens are real (default: all S); the others write nothing.

    Writing past the cache's length raises where the lengths are concrete; under jit, where they are
    traced, the overflowing rows' outputs are NaN instead (their write is dropped).

    Scores are q^T W_uk^T c = (W_uk q)^T c and outputs W_uv^T (sum_j p_j c_j), so attention runs
    in the kv_lora space as multi-query attention with a single latent head for keys and values. With
    RoPE the cached rows are [latent | rotated shared key] and the queries [W_uk q_nope | q_rope]: one
    dot gives both parts of the logit, and only the latent columns of the output are read.
    """
    check_input(x_BSD, self.cfg.d_model, "GatedMLA.decode")
    latent_BLC, filled_B = cache["latent"], cache["length"]
    B, S, L = x_BSD.shape[0], x_BSD.shape[1], latent_BLC.shape[1]
    C = self.cfg.mla.kv_lora_rank
    if latent_BLC.shape != (B, L, C + self.rope) or filled_B.shape != (B,):
      raise ValueError(f"GatedMLA.decode: cache latent {latent_BLC.shape} and length {filled_B.shape} do "
                       f"not match batch {B} and kv_lora_rank {C} + rope_head_dim {self.rope}")
    new_B = jnp.full((B,), S, jnp.int32) if lengths_B is None else jnp.asarray(lengths_B, jnp.int32)
    end_B = filled_B + new_B
    traced = any(isinstance(a, jax.core.Tracer) for a in (filled_B, new_B))
    if not traced and int(jnp.max(end_B)) > L:
      raise ValueError(f"GatedMLA.decode: appending {new_B.tolist()} tokens to rows holding "
                       f"{filled_B.tolist()} overflows the cache of length {L}")
    x_BSD = x_BSD.astype(self.dtype)
    c_BSC = self.kv_latent(x_BSD)
    pos_BS = filled_B[:, None] + jnp.arange(S, dtype=jnp.int32)[None, :]
    row_BSW = c_BSC if not self.rope else jnp.concatenate([c_BSC, self.rope_key(x_BSD, pos_BS)], axis=-1)
    # Pads' positions, and any past the end, point outside the cache: their writes are dropped.
    write_BS = jnp.where((jnp.arange(S)[None, :] < new_B[:, None]) & (pos_BS < L), pos_BS, L)
    latent_BLC = latent_BLC.at[jnp.arange(B)[:, None], write_BS].set(row_BSW.astype(latent_BLC.dtype),
                                                                     mode="drop")
    q_BSHK = self.queries(x_BSD, pos_BS)
    K = self.cfg.mla.qk_nope_head_dim

    def over_the_cache(_):
      qc_BSHC = matmul("bshk,chk->bshc", q_BSHK[..., :K], self.w_uk, self.dtype)
      if self.rope:
        qc_BSHC = jnp.concatenate([qc_BSHC, q_BSHK[..., K:].astype(qc_BSHC.dtype)], axis=-1)
      oc_BSHC = latent_attention(qc_BSHC, latent_BLC, pos_BS, self.scale)[..., :C]
      return matmul("bshc,chv->bshv", oc_BSHC, self.w_uv, self.dtype)

    def within_the_piece(_):
      # Every row starts here, so the piece attends to itself alone: the training path's kernels, on
      # per-head keys and values (fewer FLOPs than the latent form at long S). Pads end the rows, so
      # causality keeps them from the real tokens.
      k_BSHK = matmul("bsc,chk->bshk", c_BSC, self.w_uk, self.dtype)
      if self.rope:
        k_BSHK = self.with_rope_key(k_BSHK, row_BSW[..., C:])
      v_BSHV = matmul("bsc,chv->bshv", c_BSC, self.w_uv, self.dtype)
      return self.attention(q_BSHK, k_BSHK, v_BSHV, None, self.scale).astype(self.dtype)

    if S == 1:
      o_BSHV = over_the_cache(None)
    else:
      o_BSHV = jax.lax.cond(jnp.all(filled_B == 0), within_the_piece, over_the_cache, None)
    y_BSD = self.gated_output(x_BSD, o_BSHV)
    if traced:
      y_BSD = jnp.where((end_B > L)[:, None, None], jnp.nan, y_BSD)
    return y_BSD, {"latent": latent_BLC, "length": jnp.minimum(end_B, L)}
