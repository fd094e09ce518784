"""The bounded-decay Kimi Delta Attention mixer (DESIGN §2).

  q, k = L2Norm(SiLU(ShortConv(W_q x))), L2Norm(SiLU(ShortConv(W_k x))),  v = SiLU(ShortConv(W_v x))
  beta = sigmoid(W_b x),  g = lb * sigmoid(exp(A_log) * (W_fb W_fa x + dt_bias))   in [lb, 0]
  o = chunk_kda(q, k, v, g, beta)   (the delta-rule recurrence, restarted at each document)
  y = W_o( RMSNorm_head(o) * sigmoid(W_gb W_ga x + b_g) )

The recurrence itself lives in pallas_kernels.kda; this file only builds its inputs and output.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from moejax.layers.short_conv import check_segment_ids, document_ids, short_conv
from moejax.nn import check_input, kernel_init, logical_param, matmul, rms_norm
from pallas_kernels.kda import chunk_kda


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


def l2_normalize(x, eps: float):
  """x / sqrt(sum x^2 + eps) over the last axis, in float32."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)


def a_log_init(key, shape, dtype=jnp.float32):
  """log of U[1, 16]: per-head decay sharpness spread over a decade, as is common practice."""
  return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


# A depthwise tap sees W inputs of one channel, so fan_in is the conv width (axis 0).
conv_init = nn.initializers.variance_scaling(1.0, "fan_in", "uniform", in_axis=0, out_axis=(1, 2))


class KDA(nn.Module):
  """KDA mixer: __call__(x_BTD, segment_ids_BT=None) -> y_BTD. Sows the log-decay g as
  intermediates/"g" (float32 [B,T,H,K]) for inspection."""

  cfg: ml_collections.FrozenConfigDict

  @nn.compact
  def __call__(self, x_BTD, segment_ids_BT=None):
    c, kc = self.cfg, self.cfg.kda
    check_input(x_BTD, c.d_model, "KDA")
    lb = check_lower_bound(kc.gate_lower_bound)
    B, T, D = x_BTD.shape
    H, K, V, R, W = kc.num_heads, kc.head_k_dim, kc.head_v_dim, kc.gate_rank, kc.conv_size
    dtype, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)

    def param(name, shape, axes, init=None):
      init = kernel_init(1, len(shape)) if init is None else init
      return logical_param(self, name, init, shape, axes, pdt)

    doc_BT = None
    if segment_ids_BT is not None:
      check_segment_ids(segment_ids_BT, B, T)
      doc_BT = document_ids(segment_ids_BT)
    x_BTD = x_BTD.astype(dtype)

    def conv_branch(name, width):
      w = param(f"w_{name}", (D, H, width), ("embed", "heads", "kv"))
      w_conv = param(f"conv_{name}", (W, H, width), ("conv", "heads", "kv"), conv_init)
      return jax.nn.silu(short_conv(matmul("btd,dhk->bthk", x_BTD, w, dtype), w_conv, doc_BT)
                         .astype(jnp.float32))

    q_BTHK = l2_normalize(conv_branch("q", K), c.norm_eps).astype(dtype)
    k_BTHK = l2_normalize(conv_branch("k", K), c.norm_eps).astype(dtype)
    v_BTHV = conv_branch("v", V).astype(dtype)

    w_beta = param("w_beta", (D, H), ("embed", "heads"))
    beta_BTH = jax.nn.sigmoid(matmul("btd,dh->bth", x_BTD, w_beta, dtype).astype(jnp.float32))

    z_BTR = matmul("btd,dr->btr", x_BTD, param("w_decay_a", (D, R), ("embed", "rank")), dtype)
    z_BTHK = matmul("btr,rhk->bthk", z_BTR, param("w_decay_b", (R, H, K), ("rank", "heads", "kv")),
                    dtype)
    A_log_H = param("A_log", (H,), ("heads",), a_log_init)
    dt_bias_HK = param("dt_bias", (H, K), ("heads", "kv"), nn.initializers.zeros)
    g_BTHK = bounded_decay(z_BTHK, A_log_H, dt_bias_HK, lb)
    self.sow("intermediates", "g", g_BTHK)

    o_BTHV, _ = chunk_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, scale=K ** -0.5,
                          segment_ids=doc_BT, chunk_size=kc.chunk_size,
                          implementation=kc.implementation)

    # One learned scale over head_v_dim, shared by the heads.
    o_scale = param("o_norm_scale", (V,), ("norm",), nn.initializers.ones)
    o_BTHV = rms_norm(o_BTHV, o_scale, c.norm_eps)
    u_BTR = matmul("btd,dr->btr", x_BTD, param("w_gate_a", (D, R), ("embed", "rank")), dtype)
    u_BTHV = matmul("btr,rhv->bthv", u_BTR, param("w_gate_b", (R, H, V), ("rank", "heads", "kv")),
                    dtype)
    gate_bias = param("gate_bias", (H, V), ("heads", "kv"), nn.initializers.zeros)
    gate_BTHV = jax.nn.sigmoid(u_BTHV.astype(jnp.float32) + gate_bias.astype(jnp.float32))
    w_o = param("w_o", (H, V, D), ("heads", "kv", "embed"), kernel_init(2, 3))
    return matmul("bthv,hvd->btd", (o_BTHV * gate_BTHV).astype(dtype), w_o, dtype)
