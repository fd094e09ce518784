"""conv_silu: SiLU of the causal depthwise short convolution within documents, differentiable.

    y_BTC = conv_silu(x_BTC, w_WC, doc_BT, implementation=None)
          = silu(short_conv(x, w, doc) as float32), in out_dtype (default x's dtype)

x may carry extra channel axes ([B,T,H,K] with w [W,H,K]). "pallas" runs kernel.py's Triton-lowered
kernels on a GPU, "interpret" the same kernels in Pallas interpret mode (how CI tests them), "xla" the
reference's forward with a hand-written backward pass (reference.short_conv_vjp; tests hold it to
autodiff of the reference); None picks "pallas" on GPU and "xla" elsewhere. On the H200 step XLA's
fusions of the reference's forward pass and autodiff's backward took about 25 ms of the KDA layers'
37 ms of projection and convolution work (BENCHMARKS.md, "Training step profile"); the hand-written
backward pass, which asks for less memory (CPU plan at T=1M: 22 against 30 GiB), is not yet timed there.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.kda.pallas_backend import Tuning
from pallas_kernels.short_conv import kernel
from pallas_kernels.short_conv.reference import check_channels, short_conv, short_conv_vjp, silu_grad

IMPLEMENTATIONS = ("pallas", "interpret", "xla")


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Rows and columns per program (powers of two >= 16) and the kernels' launch settings."""
  rows: int = 32
  cols: int = 128
  fwd: Tuning = Tuning(num_warps=4, num_stages=1)
  bwd: Tuning = Tuning(num_warps=8, num_stages=1)

  def __post_init__(self):
    for name in ("rows", "cols"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
        raise ValueError(f"Blocks.{name} must be a power of two >= 16, got {v!r}")


def conv_silu(x_BTC, w_WC, doc_BT=None, *, implementation: str | None = None, out_dtype=None,
              blocks: Blocks | None = None):
  """silu(short_conv(x, w, doc)); see the module docstring. doc_BT: int document ids (None: one
  document per row); a tap reaches only earlier positions of its own document."""
  if implementation is None:
    implementation = "pallas" if jax.default_backend() == "gpu" else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"conv_silu implementation {implementation!r} not in {IMPLEMENTATIONS} or None")
  check_channels(x_BTC, w_WC, "conv_silu")
  B, T = x_BTC.shape[:2]
  if doc_BT is not None and (tuple(doc_BT.shape) != (B, T) or not jnp.issubdtype(doc_BT.dtype, jnp.integer)):
    raise ValueError(f"conv_silu: doc_BT must be an integer [B,T]=({B}, {T}) array, got "
                     f"{doc_BT.dtype}{tuple(doc_BT.shape)}")
  out_dtype = jnp.dtype(x_BTC.dtype if out_dtype is None else out_dtype)
  if implementation == "xla":
    return _conv_silu_xla(x_BTC, w_WC, doc_BT, out_dtype)
  if implementation == "pallas" and jax.default_backend() != "gpu":
    raise ValueError(f"conv_silu implementation='pallas' needs a GPU (backend is "
                     f"{jax.default_backend()!r}); use 'interpret' to run the kernels on the CPU")
  blocks = blocks or Blocks()
  W = w_WC.shape[0]
  C = math.prod(x_BTC.shape[2:])
  bc = min(blocks.cols, max(16, 1 << (C - 1).bit_length()))
  Cp, rows = -(-C // bc) * bc, -(-T // blocks.rows) * blocks.rows
  x = jnp.pad(x_BTC.reshape(B, T, C), ((0, 0), (W - 1, rows - T + W - 1), (0, Cp - C)))
  w = jnp.pad(w_WC.reshape(W, C), ((0, 0), (0, Cp - C)))
  doc = jnp.zeros((B, T), jnp.int32) if doc_BT is None else doc_BT.astype(jnp.int32)
  # Ids of their own for the padding: no tap of a real row reaches it.
  doc = jnp.concatenate([jnp.full((B, W - 1), -1, jnp.int32), doc,
                         jnp.full((B, rows - T + W - 1), -2, jnp.int32)], axis=1)
  st = _Static(rows=rows, block_t=blocks.rows, block_c=bc, out_dtype=out_dtype, fwd=blocks.fwd,
               bwd=blocks.bwd, interpret=implementation == "interpret")
  y = _conv_silu(st, x, w, doc)
  return y[:, :T, :C].reshape(x_BTC.shape)


@dataclasses.dataclass(frozen=True)
class _Static:
  rows: int
  block_t: int
  block_c: int
  out_dtype: jnp.dtype
  fwd: Tuning
  bwd: Tuning
  interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv_silu(st: _Static, x, w, doc):
  return kernel.forward(x, w, doc, rows=st.rows, block_t=st.block_t, block_c=st.block_c,
                        out_dtype=st.out_dtype, interpret=st.interpret, tuning=st.fwd)


def _conv_silu_fwd(st, x, w, doc):
  return _conv_silu(st, x, w, doc), (x, w, doc)


def _conv_silu_bwd(st, res, dy):
  x, w, doc = res
  W = w.shape[0]
  dy = jnp.pad(dy, ((0, 0), (0, W - 1), (0, 0)))
  dx, dw_parts = kernel.backward(x, w, doc, dy, rows=st.rows, block_t=st.block_t, block_c=st.block_c,
                                 interpret=st.interpret, tuning=st.bwd)
  # dx covers the real rows; the padding rows of x get zeros.
  dx = jnp.pad(dx, ((0, 0), (W - 1, W - 1), (0, 0)))
  return dx, jnp.sum(dw_parts, axis=(0, 1)).astype(w.dtype), None


_conv_silu.defvjp(_conv_silu_fwd, _conv_silu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _conv_silu_xla(x, w, doc, out_dtype):
  return jax.nn.silu(short_conv(x, w, doc).astype(jnp.float32)).astype(out_dtype)


def _conv_silu_xla_fwd(x, w, doc, out_dtype):
  return _conv_silu_xla(x, w, doc, out_dtype), (x, w, doc)


def _conv_silu_xla_bwd(out_dtype, res, dy):
  # The convolution is recomputed (one fused pass) rather than kept, rounded to x's dtype as in the
  # forward pass; its cotangent goes on in x's dtype, as autodiff's would through that rounding. The
  # barrier keeps XLA from merging the recomputation with the forward pass's (CSE), which would keep a
  # float32 copy of the convolution from the forward pass instead.
  x, w, doc = jax.lax.optimization_barrier(res)
  z = short_conv(x, w, doc).astype(jnp.float32)
  dz = (dy.astype(jnp.float32) * silu_grad(z)).astype(x.dtype)
  dx, dw = short_conv_vjp(dz, x, w, doc)
  return dx, dw, None


_conv_silu_xla.defvjp(_conv_silu_xla_fwd, _conv_silu_xla_bwd)
