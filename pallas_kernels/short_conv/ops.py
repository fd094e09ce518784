"""conv_silu: SiLU of the causal depthwise short convolution within documents, differentiable.

    y_BTC = conv_silu(x_BTC, w_WC, doc_BT, implementation=None, normalize_eps=None)
          = silu(short_conv(x, w, doc) as float32), in out_dtype (default x's dtype)
      or, with normalize_eps, l2_normalize(that y, as float32, over the last axis), in out_dtype

x may carry extra channel axes ([B,T,H,K] with w [W,H,K]). The normalised form is the KDA layer's q and
k (docs/design.md §2), and the Pallas kernels normalise each head in the tile that makes it, so the l2
norm costs no pass of its own, forward or backward. "pallas" runs kernel.py's Triton-lowered kernels on a GPU,
"interpret" the same kernels in Pallas interpret mode (how CI tests them), "xla" the reference's
forward with a hand-written backward pass (reference.short_conv_vjp; tests hold both to autodiff of the
reference formula); None picks "pallas" on GPU and "xla" elsewhere.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.backend import require_gpu
from pallas_kernels.kda.lowering import Tuning
from pallas_kernels.short_conv import kernel
from pallas_kernels.short_conv import reference as ref
from pallas_kernels.short_conv.reference import check_channels, short_conv, short_conv_vjp, silu_grad

IMPLEMENTATIONS = ("pallas", "interpret", "xla")


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Rows and columns per block (powers of two >= 16), row blocks per program of the backward pass's
  dz kernel, and the three kernels' launch settings. A normalised output takes one group of channels
  (the input's last axis) per column block instead of `cols`. The defaults: 16 rows, 4 warps and one
  row block per dz program timed fastest of the settings swept on the H200 at the KDA layer's shape
  (BENCHMARKS.md, "Short convolution"); several row blocks per dz program are not yet timed there."""
  rows: int = 16
  cols: int = 128
  dz_row_blocks: int = 1
  fwd: Tuning = Tuning(num_warps=4, num_stages=1)
  dz: Tuning = Tuning(num_warps=4, num_stages=1)
  dx: Tuning = Tuning(num_warps=4, num_stages=1)

  def __post_init__(self):
    n = self.dz_row_blocks
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"Blocks.dz_row_blocks must be a positive int, got {self.dz_row_blocks!r}")
    for name in ("rows", "cols"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
        raise ValueError(f"Blocks.{name} must be a power of two >= 16, got {v!r}")


def conv_silu(x_BTC, w_WC, doc_BT=None, *, implementation: str | None = None, out_dtype=None,
              normalize_eps: float | None = None, blocks: Blocks | None = None):
  """silu(short_conv(x, w, doc)); see the module docstring. doc_BT: int document ids, one id per
  document (None: one document per row); a tap reaches only earlier positions of the same id. Segment
  ids that a later document may repeat (a run of equal ids is a document, as chunk_kda and
  document_attention read them) go through pallas_kernels.segments.document_ids first. normalize_eps: when
  given, each output vector over the last axis is l2-normalised, y / sqrt(|y|^2 + eps)."""
  if implementation is None:
    implementation = "pallas" if jax.default_backend() == "gpu" else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"conv_silu implementation {implementation!r} not in {IMPLEMENTATIONS} or None")
  check_channels(x_BTC, w_WC, "conv_silu")
  B, T = x_BTC.shape[:2]
  if doc_BT is not None and (tuple(doc_BT.shape) != (B, T) or not jnp.issubdtype(doc_BT.dtype, jnp.integer)):
    raise ValueError(f"conv_silu: doc_BT must be an integer [B,T]=({B}, {T}) array, got "
                     f"{doc_BT.dtype}{tuple(doc_BT.shape)}")
  if normalize_eps is not None and not normalize_eps > 0:
    raise ValueError(f"conv_silu: normalize_eps must be > 0 or None, got {normalize_eps!r}")
  out_dtype = jnp.dtype(x_BTC.dtype if out_dtype is None else out_dtype)
  if implementation == "xla":
    return _conv_silu_xla(x_BTC, w_WC, doc_BT, out_dtype, normalize_eps)
  if implementation == "pallas":
    require_gpu("conv_silu")
  blocks = blocks or Blocks()
  W = w_WC.shape[0]
  C = math.prod(x_BTC.shape[2:])
  if normalize_eps is None:
    bc = min(blocks.cols, max(16, 1 << (C - 1).bit_length()))
  else:
    bc = x_BTC.shape[-1]
    if x_BTC.ndim < 3 or bc & (bc - 1):
      raise ValueError(f"conv_silu: the Pallas kernels normalise a power-of-two last axis, got shape "
                       f"{tuple(x_BTC.shape)}; use implementation='xla'")
  doc = None if doc_BT is None else doc_BT.astype(jnp.int32)
  st = _Static(block_c=bc, out_dtype=out_dtype, normalize_eps=normalize_eps,
               blocks=blocks, interpret=implementation == "interpret")
  y = _conv_silu(st, x_BTC.reshape(B, T, C), w_WC.reshape(W, C), doc)
  return y.reshape(x_BTC.shape)


@dataclasses.dataclass(frozen=True)
class _Static:
  block_c: int
  out_dtype: jnp.dtype
  normalize_eps: float | None
  blocks: Blocks
  interpret: bool

  def kw(self, tuning: Tuning):
    return dict(block_t=self.blocks.rows, block_c=self.block_c, interpret=self.interpret, tuning=tuning)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv_silu(st: _Static, x, w, doc):
  return kernel.forward(x, w, doc, out_dtype=st.out_dtype, normalize_eps=st.normalize_eps,
                        **st.kw(st.blocks.fwd))


def _conv_silu_fwd(st, x, w, doc):
  return _conv_silu(st, x, w, doc), (x, w, doc)


def _conv_silu_bwd(st, res, dout):
  x, w, doc = res
  dz, dw_parts = kernel.backward_dz(x, w, doc, dout, normalize_eps=st.normalize_eps,
                                    row_blocks=st.blocks.dz_row_blocks, **st.kw(st.blocks.dz))
  dx = kernel.backward_dx(dz, w, doc, **st.kw(st.blocks.dx))
  return dx, jnp.sum(dw_parts, axis=(0, 1)).astype(w.dtype), None


_conv_silu.defvjp(_conv_silu_fwd, _conv_silu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _conv_silu_xla(x, w, doc, out_dtype, normalize_eps):
  y = jax.nn.silu(short_conv(x, w, doc).astype(jnp.float32)).astype(out_dtype)
  # The barrier keeps XLA:GPU from fusing the shifted taps into what reads y (the l2 norm's reduction
  # here or in the layer): that fusion (q and k together, with the activations for the backward pass
  # as extra outputs) took 3.5 ms per KDA layer on the H200 step, about 25x what its bytes need.
  y = jax.lax.optimization_barrier(y)
  if normalize_eps is None:
    return y
  return ref.l2_normalize(y.astype(jnp.float32), normalize_eps).astype(out_dtype)


def _conv_silu_xla_fwd(x, w, doc, out_dtype, normalize_eps):
  return _conv_silu_xla(x, w, doc, out_dtype, normalize_eps), (x, w, doc)


def _conv_silu_xla_bwd(out_dtype, normalize_eps, res, dout):
  # The convolution is recomputed (one fused pass) rather than kept, rounded to x's dtype as in the
  # forward pass; its cotangent goes on in x's dtype, as autodiff's would through that rounding. The
  # barrier keeps XLA from merging the recomputation with the forward pass's (CSE), which would keep a
  # float32 copy of the convolution from the forward pass instead.
  x, w, doc = jax.lax.optimization_barrier(res)
  z = short_conv(x, w, doc).astype(jnp.float32)
  dy = dout.astype(jnp.float32)
  if normalize_eps is not None:
    dy = ref.l2_normalize_vjp(jax.nn.silu(z).astype(out_dtype).astype(jnp.float32), dy, normalize_eps)
  dz = (dy * silu_grad(z)).astype(x.dtype)
  dx, dw = short_conv_vjp(dz, x, w, doc)
  return dx, dw, None


_conv_silu_xla.defvjp(_conv_silu_xla_fwd, _conv_silu_xla_bwd)
