"""Reference causal depthwise short convolution within documents (docs/design.md §2), in XLA: the
implementation the Pallas kernels (kernel.py) must match, and the one that runs off the GPU."""

import jax
import jax.numpy as jnp


def _shift_right(x, lag: int, fill):
  """x shifted by `lag` positions along axis 1, the first `lag` entries set to `fill`."""
  if lag == 0:
    return x
  pad = jnp.full((x.shape[0], lag, *x.shape[2:]), fill, x.dtype)
  return jnp.concatenate([pad, x[:, :-lag]], axis=1)


def _shift_left(x, lag: int, fill):
  """x shifted by `lag` positions back along axis 1, the last `lag` entries set to `fill`."""
  if lag == 0:
    return x
  pad = jnp.full((x.shape[0], lag, *x.shape[2:]), fill, x.dtype)
  return jnp.concatenate([x[:, lag:], pad], axis=1)


def _same_document(doc_BT, lag: int, ndim: int):
  """[B,T,1...] mask: position t - lag exists and is in t's document."""
  same_BT = _shift_right(doc_BT, lag, -1) == doc_BT
  return same_BT.reshape(*same_BT.shape, *(1,) * (ndim - 2))


def silu_grad(z32):
  """d silu(z) / dz = s (1 + z (1 - s)) with s = sigmoid(z), float32."""
  s = jax.nn.sigmoid(z32)
  return s * (1.0 + z32 * (1.0 - s))


def l2_normalize(y32, eps: float):
  """y / sqrt(|y|^2 + eps) over the last axis, float32."""
  return y32 * jax.lax.rsqrt(jnp.sum(y32 * y32, axis=-1, keepdims=True) + eps)


def l2_normalize_vjp(y32, dout32, eps: float):
  """The cotangent of y for l2_normalize(y)'s cotangent dout: with r = (|y|^2 + eps)^(-1/2),
  r dout - r^3 y (y . dout)."""
  r = jax.lax.rsqrt(jnp.sum(y32 * y32, axis=-1, keepdims=True) + eps)
  return r * dout32 - (r * r * r) * y32 * jnp.sum(y32 * dout32, axis=-1, keepdims=True)


def check_channels(x_BTC, w_WC, op: str):
  """Raises ValueError unless w [W, *channels] has x [B, T, *channels]'s channel axes."""
  if tuple(w_WC.shape[1:]) != tuple(x_BTC.shape[2:]):
    raise ValueError(f"{op}: weight channels {w_WC.shape[1:]} do not match input channels "
                     f"{x_BTC.shape[2:]}")


def short_conv(x_BTC, w_WC, doc_BT=None):
  """Causal depthwise convolution y_t = sum_j w[j] x_{t-(W-1)+j}, restarted at document starts.

  The last tap w[W-1] multiplies the current token (the layout of a depthwise causal Conv1d), so
  weights are comparable with PyTorch checkpoints. Taps that would reach into an earlier document
  (or before position 0) contribute zero, exactly as if each document were run alone.
  x_BTC may carry extra channel axes (e.g. [B,T,H,K] with w [W,H,K]). Accumulates in float32 and
  returns x's dtype. W is small (4), so a static loop over taps is W shifted multiply-adds.
  """
  W = w_WC.shape[0]
  check_channels(x_BTC, w_WC, "short_conv")
  x32 = x_BTC.astype(jnp.float32)
  w32 = w_WC.astype(jnp.float32)
  y = jnp.zeros_like(x32)
  for lag in range(min(W, x_BTC.shape[1])):
    tap = _shift_right(x32, lag, 0.0)
    if doc_BT is not None:
      # A select, not a product: a NaN or Inf in one document must not reach the next (NaN * 0).
      tap = jnp.where(_same_document(doc_BT, lag, x_BTC.ndim), tap, 0.0)
    y = y + tap * w32[W - 1 - lag]
  return y.astype(x_BTC.dtype)


def short_conv_vjp(dy_BTC, x_BTC, w_WC, doc_BT=None):
  """(dx in x's dtype, dw in w's dtype) of short_conv(x, w, doc) for the output cotangent dy.

  The transpose of each tap is the same tap looking forward: dx_s = sum_lag w[W-1-lag] dy_{s+lag} and
  dw[W-1-lag] = sum_t dy_t x_{t-lag}, both only where t - lag is in t's document. Written as one sum
  over taps (one fused pass for dx) instead of autodiff's transpose of each tap: compiled on the CPU
  for one bf16 [1, 1M, 8, 128] input, forward and backward asked for 22.0 GiB of temporaries against
  autodiff's 30.0.
  """
  W = w_WC.shape[0]
  T = x_BTC.shape[1]
  dy32, w32 = dy_BTC.astype(jnp.float32), w_WC.astype(jnp.float32)

  def masker(doc):
    """(lag, a) -> a where t - lag is in t's document, else 0."""
    return lambda lag, a: a if doc is None else jnp.where(_same_document(doc, lag, x_BTC.ndim), a, 0.0)

  masked = masker(doc_BT)
  dx = jnp.zeros_like(dy32)
  for lag in range(min(W, T)):
    dx = dx + _shift_left(masked(lag, dy32), lag, 0.0) * w32[W - 1 - lag]
  # dw's column reductions read dy, x and the documents behind a barrier, in a pass of their own:
  # XLA:GPU otherwise fuses them with element-wise passes that share an operand (dx's, the SiLU's
  # recomputation, the other branches') and runs those in the reduction's tiling, 1.0 ms per KDA layer
  # in the H200 step (BENCHMARKS.md, "Training step profile"). With dy and x alone behind it, the
  # shared masks still merged them: two such fusions of 0.85 ms per layer.
  dy_b, x_b, doc_b = jax.lax.optimization_barrier((dy_BTC, x_BTC, doc_BT))
  dy32, x32 = dy_b.astype(jnp.float32), x_b.astype(jnp.float32)
  masked = masker(doc_b)
  dw = [jnp.zeros(w_WC.shape[1:], jnp.float32)] * W
  for lag in range(min(W, T)):
    # dw masks the product and dx masks dy alone, so the two share no masked copy of dy: a shared
    # one has two consumers, and XLA wrote it out once per tap (CPU plan: 8 GiB more at T=1M).
    dw[W - 1 - lag] = jnp.sum(masked(lag, dy32 * _shift_right(x32, lag, 0.0)), axis=(0, 1))
  return dx.astype(x_BTC.dtype), jnp.stack(dw).astype(w_WC.dtype)
