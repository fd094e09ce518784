"""Pallas (Triton lowering) kernels of per-document attention, causal or not, forward, dq and dk/dv.

Every array is [BH, T, ·] with T a multiple of each block. A document is a contiguous run of positions,
so the keys a query block can reach start at the document start of its first query (`start`), and the
queries that reach a key block end at the document end of its last key (`end`); without causality the
keys also end at the document end of the block's last query, and the queries start at the document
start of its first key. Each kernel loops only over that span, which for packed rows of short documents
is a band around the diagonal instead of the whole causal triangle (or square). Masks inside the span
are exact: same document, and causal when `causal` (a static flag: one set of kernels for both modes).

Softmax runs in base 2 (scores scaled by log2 e) and the forward pass saves the base-2 log-sum-exp.
It also writes each query's largest visible score (base 2), which QK-clip needs and which the online
softmax has at hand: a [BH, T] float32 write instead of a second Q K^T pass.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_F32 = jnp.float32
LOG2E = math.log2(math.e)
# Finite, so a query row with no visible key in the blocks visited so far does not produce inf - inf.
# Every query sees at least itself, in either mode: the first block holding a key it sees rescales what
# the fully masked blocks before it added by exp2(_MASKED - m) = 0, and masked scores after it (blocks
# past its document's end, which only the non-causal kernels visit) add exp2(_MASKED - m) = 0.
_MASKED = -1e30
_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


def _dot(a, b, dims):
  # Triton reads DEFAULT as tf32 for float32 operands; float32 callers expect float32 products.
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_F32)


def _visible(q_doc, q_pos, k_doc, k_pos, causal):
  same = q_doc[:, None] == k_doc[None, :]
  return same & (q_pos[:, None] >= k_pos[None, :]) if causal else same


def _key_blocks(i, start_ref, end_ref, *, bq, bk, causal):
  """[first, stop): the key blocks of query block i's documents, from its first query's document start
  to its last query (causal) or its last query's document end."""
  first, last = start_ref[i * bq] // bk, i * bq + bq - 1
  return first, last // bk + 1 if causal else (end_ref[last] + bk - 1) // bk


def _forward_kernel(q_ref, k_ref, v_ref, doc_ref, start_ref, end_ref, o_ref, lse_ref, max_ref, *, bq, bk,
                    scale, causal):
  i = pl.program_id(0)
  q = q_ref[...]
  q_pos = i * bq + jnp.arange(bq)
  q_doc = doc_ref[pl.ds(i * bq, bq)]

  def visit(j, carry):
    acc, m, l = carry
    k_pos = j * bk + jnp.arange(bk)
    s = _dot(q, k_ref[pl.ds(j * bk, bk), :], _NT) * (scale * LOG2E)
    s = jnp.where(_visible(q_doc, q_pos, doc_ref[pl.ds(j * bk, bk)], k_pos, causal), s, _MASKED)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    rescale = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    v = v_ref[pl.ds(j * bk, bk), :]
    acc = acc * rescale[:, None] + _dot(p.astype(v.dtype), v, _NN)
    return acc, m_new, l * rescale + jnp.sum(p, axis=1)

  first, stop = _key_blocks(i, start_ref, end_ref, bq=bq, bk=bk, causal=causal)
  init = (jnp.zeros((bq, v_ref.shape[-1]), _F32), jnp.full((bq,), _MASKED, _F32), jnp.zeros((bq,), _F32))
  acc, m, l = lax.fori_loop(first, stop, visit, init)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l)
  max_ref[...] = m


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, doc_ref, start_ref, end_ref, dq_ref, *, bq,
               bk, scale, causal):
  i = pl.program_id(0)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_pos = i * bq + jnp.arange(bq)
  q_doc = doc_ref[pl.ds(i * bq, bq)]

  def visit(j, dq):
    k_pos = j * bk + jnp.arange(bk)
    k = k_ref[pl.ds(j * bk, bk), :]
    s = _dot(q, k, _NT) * (scale * LOG2E)
    keep = _visible(q_doc, q_pos, doc_ref[pl.ds(j * bk, bk)], k_pos, causal)
    p = jnp.where(keep, jnp.exp2(s - lse[:, None]), 0.0)
    dp = _dot(do, v_ref[pl.ds(j * bk, bk), :], _NT)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k, _NN)

  first, stop = _key_blocks(i, start_ref, end_ref, bq=bq, bk=bk, causal=causal)
  dq = lax.fori_loop(first, stop, visit, jnp.zeros((bq, q_ref.shape[-1]), _F32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, doc_ref, start_ref, end_ref, dk_ref, dv_ref,
                *, bq, bk, scale, causal):
  j = pl.program_id(0)
  k, v = k_ref[...], v_ref[...]
  k_pos = j * bk + jnp.arange(bk)
  k_doc = doc_ref[pl.ds(j * bk, bk)]

  def visit(i, carry):
    dk, dv = carry
    q_pos = i * bq + jnp.arange(bq)
    q = q_ref[pl.ds(i * bq, bq), :]
    do = do_ref[pl.ds(i * bq, bq), :]
    s = _dot(q, k, _NT) * (scale * LOG2E)
    keep = _visible(doc_ref[pl.ds(i * bq, bq)], q_pos, k_doc, k_pos, causal)
    p = jnp.where(keep, jnp.exp2(s - lse_ref[pl.ds(i * bq, bq)][:, None]), 0.0)
    dv = dv + _dot(p.astype(do.dtype), do, _TN)
    ds = p * (_dot(do, v, _NT) - delta_ref[pl.ds(i * bq, bq)][:, None])
    return dk + _dot(ds.astype(q.dtype), q, _TN), dv

  # Queries before the block's first key (causal) or its first key's document start cannot see it; past
  # its last key's document end none can.
  first = (j * bk) // bq if causal else start_ref[j * bk] // bq
  stop = (end_ref[j * bk + bk - 1] + bq - 1) // bq
  init = (jnp.zeros((bk, k_ref.shape[-1]), _F32), jnp.zeros((bk, v_ref.shape[-1]), _F32))
  dk, dv = lax.fori_loop(first, stop, visit, init)
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(num_warps, num_stages):
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _row(heads):
  """BlockSpec of a whole per-batch-row [B, T] array, for the program of head row bh."""
  return lambda T: pl.BlockSpec((None, T), lambda blk, bh: (bh // heads, 0))


def forward(q, k, v, doc, start, end, *, causal, heads, blocks, scale, interpret):
  """(o [BH,T,V] in q's dtype, lse [BH,T] and each row's largest visible score [BH,T], float32, base 2).

  `end` is read only when not causal (a causal query block stops at its last query): causal, it may be
  None and is not passed to the kernel."""
  BH, T, D = q.shape
  V = v.shape[-1]
  bq, bk = blocks.fwd_q, blocks.fwd_k
  tile = lambda b, w: pl.BlockSpec((None, b, w), lambda blk, bh: (bh, blk, 0))
  whole = lambda w: pl.BlockSpec((None, T, w), lambda blk, bh: (bh, 0, 0))
  row = _row(heads)
  spans = [start] if causal else [start, end]

  def body(q_ref, k_ref, v_ref, doc_ref, start_ref, *refs):
    end_ref, outs = (None, refs) if causal else (refs[0], refs[1:])
    _forward_kernel(q_ref, k_ref, v_ref, doc_ref, start_ref, end_ref, *outs, bq=bq, bk=bk, scale=scale,
                    causal=causal)

  return pl.pallas_call(
      body,
      grid=(T // bq, BH),
      in_specs=[tile(bq, D), whole(D), whole(V), row(T)] + [row(T)] * len(spans),
      out_specs=[tile(bq, V)] + [pl.BlockSpec((None, bq), lambda blk, bh: (bh, blk))] * 2,
      out_shape=[jax.ShapeDtypeStruct((BH, T, V), q.dtype)] + [jax.ShapeDtypeStruct((BH, T), _F32)] * 2,
      compiler_params=_params(blocks.fwd_warps, blocks.fwd_stages), interpret=interpret,
      name="document_attention_fwd")(q, k, v, doc, *spans)


def backward(q, k, v, do, lse, delta, doc, start, end, *, causal, heads, blocks, scale, interpret):
  """(dq, dk, dv) in the inputs' dtypes. Causal, dq reads no `end` and dk/dv no `start`."""
  BH, T, D = q.shape
  V = v.shape[-1]
  tile = lambda b, w: pl.BlockSpec((None, b, w), lambda blk, bh: (bh, blk, 0))
  tile_vec = lambda b: pl.BlockSpec((None, b), lambda blk, bh: (bh, blk))
  whole = lambda w: pl.BlockSpec((None, T, w), lambda blk, bh: (bh, 0, 0))
  whole_vec = pl.BlockSpec((None, T), lambda blk, bh: (bh, 0))
  row = _row(heads)

  bq, bk = blocks.dq_q, blocks.dq_k
  dq = pl.pallas_call(
      lambda *refs: _dq_kernel(*refs, bq=bq, bk=bk, scale=scale, causal=causal),
      grid=(T // bq, BH),
      in_specs=[tile(bq, D), whole(D), whole(V), tile(bq, V), tile_vec(bq), tile_vec(bq)] + [row(T)] * 3,
      out_specs=tile(bq, D), out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_params(blocks.bwd_warps, blocks.bwd_stages), interpret=interpret,
      name="document_attention_dq")(q, k, v, do, lse, delta, doc, start, end)

  bq, bk = blocks.dkv_q, blocks.dkv_k
  dk, dv = pl.pallas_call(
      lambda *refs: _dkv_kernel(*refs, bq=bq, bk=bk, scale=scale, causal=causal),
      grid=(T // bk, BH),
      in_specs=[whole(D), tile(bk, D), tile(bk, V), whole(V), whole_vec, whole_vec] + [row(T)] * 3,
      out_specs=[tile(bk, D), tile(bk, V)],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(blocks.bwd_warps, blocks.bwd_stages), interpret=interpret,
      name="document_attention_dkv")(q, k, v, do, lse, delta, doc, start, end)
  return dq, dk, dv
