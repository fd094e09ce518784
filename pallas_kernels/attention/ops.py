"""document_attention: attention within packed documents, causal (a language model's) or bidirectional
(causal=False: a vision encoder's, over images packed into one row), differentiable, on Pallas kernels.

    o_BTHV = document_attention(q_BTHD, k_BTHD, v_BTHV, segment_ids_BT, scale=D ** -0.5, causal=True)

A document is a run of equal consecutive segment ids (so ids may repeat further on without joining);
no query sees a key of another document in either mode.
"pallas" runs the Triton-lowered kernels of kernel.py on a GPU, "interpret" the same kernels in Pallas
interpret mode (any backend; how CI tests them), "xla" the dense reference (memory quadratic in T).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention import kernel
from pallas_kernels.attention.reference import document_attention_reference
from pallas_kernels.backend import require_gpu
from pallas_kernels.segments import document_ids

IMPLEMENTATIONS = ("pallas", "interpret", "xla")


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Query and key block sizes (powers of two >= 16) and launch settings of the three kernels."""
  fwd_q: int = 128
  fwd_k: int = 64
  dq_q: int = 64
  dq_k: int = 64
  dkv_q: int = 64
  dkv_k: int = 64
  fwd_warps: int = 8
  fwd_stages: int = 3
  bwd_warps: int = 4
  bwd_stages: int = 2

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"Blocks.{f.name} must be a positive int, got {v!r}")
      if not f.name.endswith(("warps", "stages")) and (v < 16 or v & (v - 1)):
        raise ValueError(f"Blocks.{f.name} must be a power of two >= 16, got {v}")

  @property
  def multiple(self) -> int:
    """Rows are padded to a multiple of this (every block divides it)."""
    return max(self.fwd_q, self.fwd_k, self.dq_q, self.dq_k, self.dkv_q, self.dkv_k)


def document_attention(q_BTHD, k_BTHD, v_BTHV, segment_ids_BT=None, *, scale: float, causal: bool = True,
                       implementation: str = "pallas", blocks: Blocks | None = None,
                       return_max_logit: bool = False):
  """softmax(scale q k^T) v over the keys j <= i in query i's document (causal=False: every key of that
  document); [B, T, H, V] in q's dtype.

  segment_ids_BT None means one document per row. Work and memory grow with T times the document
  length (the whole causal triangle, or square, for a single document), never with T^2 tiles outside
  documents.
  return_max_logit: also return, per head, the largest logit scale q.k over every visible pair of
  every row, float32 [H] without gradient (QK-clip's statistic); the kernels' online softmax has it.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if (q_BTHD.ndim != 4 or v_BTHV.ndim != 4 or k_BTHD.shape != q_BTHD.shape
      or v_BTHV.shape[:3] != q_BTHD.shape[:3]):
    raise ValueError(f"want q, k [B,T,H,D] of one shape and v [B,T,H,V]; got {q_BTHD.shape}, "
                     f"{k_BTHD.shape}, {v_BTHV.shape}")
  if len({q_BTHD.dtype, k_BTHD.dtype, v_BTHV.dtype}) != 1:
    raise ValueError(f"q, k, v must share a dtype; got {q_BTHD.dtype}, {k_BTHD.dtype}, {v_BTHV.dtype}")
  if not jnp.issubdtype(q_BTHD.dtype, jnp.floating):
    raise ValueError(f"q, k, v must be floating point, got {q_BTHD.dtype}")
  if not isinstance(causal, bool):
    raise ValueError(f"causal must be a Python bool (it is static), got {causal!r}")
  B, T, H, _ = q_BTHD.shape
  if segment_ids_BT is not None:
    if tuple(segment_ids_BT.shape) != (B, T) or not jnp.issubdtype(segment_ids_BT.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be an integer [B,T]=({B}, {T}) array, got "
                       f"{segment_ids_BT.dtype}{tuple(segment_ids_BT.shape)}")
  if implementation == "xla":
    return document_attention_reference(q_BTHD, k_BTHD, v_BTHV, segment_ids_BT, scale=scale, causal=causal,
                                        return_max_logit=return_max_logit)
  if implementation == "pallas":
    require_gpu("document_attention", "'interpret' (Pallas interpret mode) or 'xla'")
  blocks = blocks or Blocks()
  if not isinstance(blocks, Blocks):
    raise ValueError(f"blocks must be a Blocks, got {blocks!r}")

  doc_BT = jnp.zeros((B, T), jnp.int32) if segment_ids_BT is None else document_ids(segment_ids_BT)
  pad = -T % blocks.multiple
  # Padding is one more document at the end of the row: its own id hides it from real queries in either
  # mode and keeps it out of the last document's key and query spans.
  doc_BT = jnp.concatenate([doc_BT, jnp.broadcast_to(doc_BT[:, -1:] + 1, (B, pad))], axis=1)

  def to_rows(x_BTHW):
    """[B*H, T+pad, W'] with W' the next power of two >= 16 (Triton tiles): zero columns change
    neither q.k nor the output columns that are kept."""
    width = max(16, 1 << (x_BTHW.shape[-1] - 1).bit_length())
    x_BTHW = jnp.pad(x_BTHW, ((0, 0), (0, pad), (0, 0), (0, width - x_BTHW.shape[-1])))
    return x_BTHW.transpose(0, 2, 1, 3).reshape(B * H, T + pad, width)

  st = _Static(H, blocks, float(scale), causal, implementation == "interpret")
  o, row_max = _attention_jit(st, to_rows(q_BTHD), to_rows(k_BTHD), to_rows(v_BTHV), doc_BT)
  o_BTHV = o.reshape(B, H, T + pad, -1).transpose(0, 2, 1, 3)[:, :T, :, :v_BTHV.shape[-1]]
  if not return_max_logit:
    return o_BTHV
  # Base-2 scores back to logits; the padding rows (a document of their own) are left out.
  max_H = jnp.max(row_max.reshape(B, H, T + pad)[:, :, :T], axis=(0, 2)) / kernel.LOG2E
  return o_BTHV, jax.lax.stop_gradient(max_H)


@dataclasses.dataclass(frozen=True)
class _Static:
  heads: int
  blocks: Blocks
  scale: float
  causal: bool
  interpret: bool


def _spans(doc_BT):
  """(start, end): the first position of each position's document and one past its last."""
  B, T = doc_BT.shape
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  first = jnp.concatenate([jnp.ones((B, 1), bool), doc_BT[:, 1:] != doc_BT[:, :-1]], axis=1)
  last = jnp.concatenate([doc_BT[:, 1:] != doc_BT[:, :-1], jnp.ones((B, 1), bool)], axis=1)
  start = jax.lax.cummax(jnp.where(first, pos, 0), axis=1)
  end = jax.lax.cummin(jnp.where(last, pos + 1, T), axis=1, reverse=True)
  return start, end


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: _Static, q, k, v, doc):
  """(o, each row's largest visible score in base 2); the second output carries no gradient."""
  o, _, row_max = _forward(st, q, k, v, doc)
  return o, row_max


def _forward(st, q, k, v, doc):
  start, end = _spans(doc)
  return kernel.forward(q, k, v, doc, start, None if st.causal else end, causal=st.causal, heads=st.heads,
                        blocks=st.blocks, scale=st.scale, interpret=st.interpret)


def _attention_fwd(st, q, k, v, doc):
  o, lse, row_max = _forward(st, q, k, v, doc)
  return (o, row_max), (q, k, v, doc, o, lse)


def _attention_bwd(st, res, cts):
  q, k, v, doc, o, lse = res
  do, _ = cts  # the row maxima feed QK-clip only, which does not differentiate them
  do = do.astype(o.dtype)
  delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
  start, end = _spans(doc)
  dq, dk, dv = kernel.backward(q, k, v, do, lse, delta, doc, start, end, causal=st.causal, heads=st.heads,
                               blocks=st.blocks, scale=st.scale, interpret=st.interpret)
  return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)
# One jitted function for every layer of a model: traced, differentiated and lowered once.
_attention_jit = jax.jit(_attention, static_argnums=0)
