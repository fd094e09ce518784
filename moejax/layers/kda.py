"""The bounded-decay Kimi Delta Attention mixer (docs/design.md §2).

  q, k = L2Norm(SiLU(ShortConv(W_q x))), L2Norm(SiLU(ShortConv(W_k x))),  v = SiLU(ShortConv(W_v x))
  beta = sigmoid(W_b x),  g = lb * sigmoid(exp(A_log) * (W_fb W_fa x + dt_bias))   in [lb, 0]
  o = chunk_kda(q, k, v, g, beta)   (the delta-rule recurrence, restarted at each document)
  y = W_o( RMSNorm_head(o) * sigmoid(W_gb W_ga x + b_g) )

The recurrence itself lives in pallas_kernels.kda; this file only builds its inputs and output.
"""

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from moejax.layers.packing import Appended, document_ids_of
from moejax.nn import check_input, kernel_init, logical_param, matmul, rms_norm
from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda.recurrent import recurrent_kda
from pallas_kernels.short_conv import conv_silu

GATES = ("bounded", "unbounded")


def check_lower_bound(lb: float) -> float:
  lb = float(lb)
  if not -5.0 <= lb < 0.0:
    raise ValueError(f"KDA gate_lower_bound={lb} must lie in [-5, 0): below -5 a 16-token tile's "
                     f"exponent leaves fp32 range, at 0 the state never decays")
  return lb


def bounded_decay(z_BTHK, A_log_H, dt_bias_HK, lb: float):
  """Per-channel log-decay g = lb * sigmoid(exp(A_log) * (z + dt_bias)), float32.

  Lies in [lb, 0] for any non-NaN input, infinities included: sigmoid saturates instead of
  overflowing. It reaches exactly 0 (no decay, a factor of 1) once sigmoid underflows in fp32, for
  exp(A_log) * (z + dt_bias) below about -88 (CPU); every kernel factor then stays <= 1 as required.
  """
  a_H11 = jnp.exp(A_log_H.astype(jnp.float32))[:, None]
  s = a_H11 * (z_BTHK.astype(jnp.float32) + dt_bias_HK.astype(jnp.float32))
  return lb * jax.nn.sigmoid(s)


def unbounded_decay(z_BTHK, A_log_H, dt_bias_HK):
  """The original KDA gate, for ablations: g = -exp(A_log) * softplus(z + dt_bias), float32, in (-inf, 0].
  Only the token-by-token recurrence takes it (model.kda.gate "unbounded" needs implementation
  "recurrent"): the chunked forms factor each tile's decays, which the bound keeps within float32."""
  a_H11 = jnp.exp(A_log_H.astype(jnp.float32))[:, None]
  return -a_H11 * jax.nn.softplus(z_BTHK.astype(jnp.float32) + dt_bias_HK.astype(jnp.float32))


def a_log_init(key, shape, dtype=jnp.float32):
  """log of U[1, 16]: per-head decay sharpness spread over a decade, as is common practice."""
  return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


# A depthwise tap sees W inputs of one channel, so fan_in is the conv width (axis 0).
conv_init = nn.initializers.variance_scaling(1.0, "fan_in", "uniform", in_axis=0, out_axis=(1, 2))


class KDACarry(NamedTuple):
  """What one pass over a piece of the row hands the next (`KDA.seq_chunk`), and the layer's decode
  cache: the recurrent state, the last conv_size - 1 pre-convolution q/k/v projections (the short
  convolution's history), their document ids, and the document id of the piece's last position (kept
  apart: with conv_size 1 there is no history). `empty` is a cache before the row starts."""
  state_BHKV: jax.Array  # float32
  tails: dict  # {"q", "k", "v"}: [B, W-1, H, K or V]
  tail_doc_BW: jax.Array  # int32 [B, W-1]; -1 before the row starts
  last_doc_B: jax.Array  # int32 [B]; -1 before the row starts

  @classmethod
  def empty(cls, B, H, K, V, W, dtype):
    tail = lambda width: jnp.zeros((B, W - 1, H, width), dtype)
    return cls(jnp.zeros((B, H, K, V), jnp.float32), {"q": tail(K), "k": tail(K), "v": tail(V)},
               jnp.full((B, W - 1), -1, jnp.int32), jnp.full((B,), -1, jnp.int32))


def init_kda_cache(cfg: ml_collections.FrozenConfigDict, batch: int) -> KDACarry:
  """An empty decode cache of a KDA layer (config.model): nothing before the row starts."""
  kc = cfg.kda
  return KDACarry.empty(batch, kc.num_heads, kc.head_k_dim, kc.head_v_dim, kc.conv_size, jnp.dtype(cfg.dtype))


class KDA(nn.Module):
  """KDA mixer: __call__(x_BTD, packing=None, cache=None) -> (y_BTD, cache). Sows the log-decay g as
  intermediates/"g" (float32 [B,T,H,K]) for inspection.

  packing: a `moejax.layers.packing.Packing`, segment ids, or None (one document a row); with a cache
  also an `Appended` (one document a row, padded at its end). cache: None (the row starts here; None
  comes back), or a `KDACarry` that the row continues from (`init_kda_cache` for an empty one); the
  carry after the row's last real position comes back.

  With cfg.kda.seq_chunk > 0 (it must divide T), the layer runs over the row in pieces of that many
  tokens, one after another, handing on the recurrent state and the convolution's history, each piece
  rematerialised in the backward pass: the same function, with one piece's activations live at a time
  instead of the row's (what bounds the layer's memory at T = 1M).
  """

  cfg: ml_collections.FrozenConfigDict

  def _params(self) -> dict:
    c, kc = self.cfg, self.cfg.kda
    D, H, K, V, R, W = c.d_model, kc.num_heads, kc.head_k_dim, kc.head_v_dim, kc.gate_rank, kc.conv_size
    pdt = jnp.dtype(c.param_dtype)
    p = {}

    def param(name, shape, axes, init=None):
      init = kernel_init(1, len(shape)) if init is None else init
      p[name] = logical_param(self, name, init, shape, axes, pdt)

    for name, width in (("q", K), ("k", K), ("v", V)):
      param(f"w_{name}", (D, H, width), ("embed", "heads", "kv"))
      param(f"conv_{name}", (W, H, width), ("conv", "heads", "kv"), conv_init)
    param("w_beta", (D, H), ("embed", "heads"))
    param("w_decay_a", (D, R), ("embed", "rank"))
    param("w_decay_b", (R, H, K), ("rank", "heads", "kv"))
    param("A_log", (H,), ("heads",), a_log_init)
    param("dt_bias", (H, K), ("heads", "kv"), nn.initializers.zeros)
    # One learned scale over head_v_dim, shared by the heads.
    param("o_norm_scale", (V,), ("norm",), nn.initializers.ones)
    param("w_gate_a", (D, R), ("embed", "rank"))
    param("w_gate_b", (R, H, V), ("rank", "heads", "kv"))
    param("gate_bias", (H, V), ("heads", "kv"), nn.initializers.zeros)
    param("w_o", (H, V, D), ("heads", "kv", "embed"), kernel_init(2, 3))
    return p

  @nn.compact
  def __call__(self, x_BTD, packing=None, cache: KDACarry | None = None):
    c, kc = self.cfg, self.cfg.kda
    check_input(x_BTD, c.d_model, "KDA")
    B, T, _ = x_BTD.shape
    p = self._params()
    appended = packing if isinstance(packing, Appended) else None
    doc_BT = None if appended is not None else document_ids_of(packing, B, T)
    x_BTD = x_BTD.astype(jnp.dtype(c.dtype))
    want_g = self.is_mutable_collection("intermediates")
    piece = kc.seq_chunk
    if appended is not None and cache is None:
      raise ValueError("KDA: tokens `Appended` to a cache need the cache")
    if cache is not None:
      doc_BT = jnp.zeros((B, T), jnp.int32) if doc_BT is None else doc_BT
      y_BTD, g_BTHK, cache = kda_mixer(p, c, x_BTD, doc_BT, cache,
                                       lengths_B=None if appended is None else appended.lengths_B)
    elif not piece or T <= piece:
      y_BTD, g_BTHK, _ = kda_mixer(p, c, x_BTD, doc_BT)
    else:
      y_BTD, g_BTHK = self._in_pieces(p, x_BTD, doc_BT, piece, want_g)
    if want_g:
      self.sow("intermediates", "g", g_BTHK)
    return y_BTD, cache

  def _in_pieces(self, p, x_BTD, doc_BT, piece: int, want_g: bool):
    c, kc = self.cfg, self.cfg.kda
    B, T, D = x_BTD.shape
    if T % piece:
      raise ValueError(f"model.kda.seq_chunk={piece} does not divide the row length T={T}")
    n = T // piece
    if doc_BT is None:
      doc_BT = jnp.zeros((B, T), jnp.int32)
    piece_of = lambda a, i: jax.lax.slice_in_dim(a, i * piece, (i + 1) * piece, axis=1)

    @jax.checkpoint
    def one(carry, x_BCD, doc_BC):
      y_BCD, g_BCHK, carry = kda_mixer(p, c, x_BCD, doc_BC, carry)
      return y_BCD, (g_BCHK if want_g else None), carry

    # A Python loop, not lax.scan: see moejax.nn.remat_pieces for what a scan's buffers cost on the GPU.
    carry = KDACarry.empty(B, kc.num_heads, kc.head_k_dim, kc.head_v_dim, kc.conv_size, x_BTD.dtype)
    ys, gs = [], []
    for i in range(n):
      y_BCD, g_BCHK, carry = one(carry, piece_of(x_BTD, i), piece_of(doc_BT, i))
      ys.append(y_BCD)
      gs.append(g_BCHK)
    return jnp.concatenate(ys, axis=1), (jnp.concatenate(gs, axis=1) if want_g else None)


def kda_mixer(p: dict, c, x_BTD, doc_BT, carry: KDACarry | None = None, lengths_B=None):
  """The KDA mixer on x [B,T,D] with params p: (y_BTD, g_BTHK, carry after the last position).

  carry=None: the row starts here (nothing before position 0). Otherwise the row continues one that
  ended in `carry`, and doc_BT holds document ids comparable with the carry's. lengths_B (with a
  carry): only the first lengths_B[b] tokens of row b are real, and the carry that comes back is the
  one after the last of them. The pads get no write (beta = 0) and no decay (g = 0), so the recurrent
  state passes through them unchanged, and the convolution's history is read at the last real token.
  """
  kc, dtype = c.kda, jnp.dtype(c.dtype)
  K = kc.head_k_dim
  lb = check_lower_bound(kc.gate_lower_bound)
  if kc.gate not in GATES:
    raise ValueError(f"model.kda.gate={kc.gate!r} not in {GATES}")
  if kc.gate == "unbounded" and kc.implementation != "recurrent":
    raise ValueError("model.kda.gate='unbounded' needs model.kda.implementation='recurrent': the chunked "
                     "kernels rely on the bound")
  # With a carry, the convolution reaches back into the previous piece's last w = W-1 tokens: it runs
  # over those and this piece, and the last w real tokens of that extended row are what the next piece
  # needs.
  w = 0 if carry is None else carry.tail_doc_BW.shape[1]
  # A decode step convolves W tokens: XLA's few elementwise ops, not a kernel launched over a padded tile.
  conv_impl = "xla" if carry is not None and x_BTD.shape[1] == 1 else kc.conv_implementation
  doc_ext = doc_BT if carry is None else jnp.concatenate([carry.tail_doc_BW, doc_BT], axis=1)

  def conv_branch(name, normalize: bool):
    ext_BTHK = matmul("btd,dhk->bthk", x_BTD, p[f"w_{name}"], dtype)
    if carry is not None:
      ext_BTHK = jnp.concatenate([carry.tails[name].astype(ext_BTHK.dtype), ext_BTHK], axis=1)
    # In the compute dtype, as the layer's other activations. q and k come out l2-normalised over each
    # head (in float32 from the rounded SiLU): the Pallas kernels do it in the tile that makes the head,
    # so the norm costs no pass of its own, forward or backward.
    y = conv_silu(ext_BTHK, p[f"conv_{name}"], doc_ext, implementation=conv_impl, out_dtype=dtype,
                  normalize_eps=c.norm_eps if normalize else None)[:, w:]
    return y, ext_BTHK

  # The named scopes label this layer's parts in profiles (tools/trace_parts.py).
  with jax.named_scope("qkv_conv"):
    (q_BTHK, q_ext), (k_BTHK, k_ext), (v_BTHV, v_ext) = (
        conv_branch(n, normalize) for n, normalize in (("q", True), ("k", True), ("v", False)))
  with jax.named_scope("gates"):
    beta_BTH = jax.nn.sigmoid(matmul("btd,dh->bth", x_BTD, p["w_beta"], dtype).astype(jnp.float32))
    z_BTR = matmul("btd,dr->btr", x_BTD, p["w_decay_a"], dtype)
    z_BTHK = matmul("btr,rhk->bthk", z_BTR, p["w_decay_b"], dtype)
    g_BTHK = (bounded_decay(z_BTHK, p["A_log"], p["dt_bias"], lb) if kc.gate == "bounded"
              else unbounded_decay(z_BTHK, p["A_log"], p["dt_bias"]))
  B, T = x_BTD.shape[:2]
  if lengths_B is not None:
    valid_BT = jnp.arange(T, dtype=jnp.int32)[None, :] < lengths_B[:, None]
    beta_BTH = jnp.where(valid_BT[:, :, None], beta_BTH, 0.0)
    g_BTHK = jnp.where(valid_BT[:, :, None, None], g_BTHK, 0.0)

  state_in = None
  if carry is not None:
    # The state carries over only while the previous piece's last document goes on.
    same_B = doc_BT[:, 0] == carry.last_doc_B
    state_in = jnp.where(same_B[:, None, None, None], carry.state_BHKV, 0.0)
  with jax.named_scope("chunk_kda"):
    if carry is not None and T == 1:
      # A decode step: one token's update of the state, instead of a whole chunk padded around it.
      o_BTHV, state_out = recurrent_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale=K ** -0.5,
                                        initial_state=state_in, output_final_state=True)
    else:
      o_BTHV, state_out = chunk_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale=K ** -0.5,
                                    initial_state=state_in, output_final_state=carry is not None,
                                    segment_ids=doc_BT, chunk_size=kc.chunk_size,
                                    implementation=kc.implementation)

  with jax.named_scope("output"):
    o_BTHV = rms_norm(o_BTHV, p["o_norm_scale"], c.norm_eps)
    u_BTR = matmul("btd,dr->btr", x_BTD, p["w_gate_a"], dtype)
    u_BTHV = matmul("btr,rhv->bthv", u_BTR, p["w_gate_b"], dtype)
    gate_BTHV = jax.nn.sigmoid(u_BTHV.astype(jnp.float32) + p["gate_bias"].astype(jnp.float32))
    y_BTD = matmul("bthv,hvd->btd", (o_BTHV * gate_BTHV).astype(dtype), p["w_o"], dtype)
  if carry is None:
    return y_BTD, g_BTHK, None
  if lengths_B is None:
    tail = lambda a: a[:, a.shape[1] - w:]
    last_doc_B = doc_BT[:, -1]
  else:  # the history ends at the last real token: positions [n, n + w) of each extended row
    at_BW = lengths_B[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]
    tail = lambda a: jnp.take_along_axis(a, at_BW.reshape(at_BW.shape + (1,) * (a.ndim - 2)), axis=1)
    last_B = jnp.take_along_axis(doc_BT, jnp.maximum(lengths_B - 1, 0)[:, None], axis=1)[:, 0]
    last_doc_B = jnp.where(lengths_B > 0, last_B, carry.last_doc_B)
  new = KDACarry(state_out, {"q": tail(q_ext), "k": tail(k_ext), "v": tail(v_ext)}, tail(doc_ext), last_doc_B)
  return y_BTD, g_BTHK, new
