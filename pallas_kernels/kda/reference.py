"""KDA in chunked matmul form, pure XLA (docs/design.md §2 "Chunked form"): the reference the Pallas
kernels are tested against.

With C-token chunks and G = in-chunk inclusive cumsum of g, each chunk with incoming state S gives
  A_kk[i,j] = b_i sum_d k_id k_jd e^{G_id - G_jd} (j < i),   M = (I + A_kk)^{-1} Diag(b),
  W = M (k e^G),  U = M v,  V' = U - W S,
  O = scale [(q e^G) S + tril_incl(A_qk) V'],               A_qk[i,j] = sum_d q_id k_jd e^{G_id - G_jd},
  S <- Diag(e^{G_C}) S + (k e^{G_C - G})^T V'.
Everything except the S pass is independent per chunk; the S pass is a lax.scan over chunks.

The intra-chunk scores are built from 16-token tiles anchored on each row tile's first row a:
  e^{G_i - G_j} = e^{G_i - G_a} e^{G_a - G_j}.
With g >= -5 both factors stay within e^{+-75} inside a diagonal tile (fp32 overflows past e^{88.7}),
and for earlier tiles both exponents are <= 0, so every tile is a plain dense product. The anchor is the
first row because a later anchor would make a row's score depend on gates after it.
"""

import functools

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

TILE = 16

# This is the reference path: no TF32 on GPU.
_HI = jax.lax.Precision.HIGHEST


def _tiled_scores(x_BHNCK, k_BHNCK, G_BHNCK):
  """[B,H,N,C,C]: sum_d x_id k_jd e^{G_id - G_jd} for j up to the end of i's tile, 0 for later j.

  Entries j > i inside the diagonal tile are finite but meaningless; the caller masks them.
  """
  B, H, N, C, K = x_BHNCK.shape
  P = C // TILE
  G_BHNPLK = G_BHNCK.reshape(B, H, N, P, TILE, K)
  # The anchor cancels in every product, so it carries no gradient: treating it as a constant keeps
  # the backward pass free of cancelling rounding noise (which would leak across documents).
  anchor_BHNPK = jax.lax.stop_gradient(G_BHNPLK[..., 0, :])
  xs_BHNPLK = x_BHNCK.reshape(B, H, N, P, TILE, K) * jnp.exp(G_BHNPLK - anchor_BHNPK[..., None, :])
  # Columns past the row tile would need e^{+5 * distance}: cut them before the exp, not after.
  visible_PC = jnp.arange(C)[None, :] < (jnp.arange(P)[:, None] + 1) * TILE
  expo_BHNPCK = anchor_BHNPK[..., :, None, :] - G_BHNCK[..., None, :, :]
  expo_BHNPCK = jnp.where(visible_PC[:, :, None], expo_BHNPCK, -jnp.inf)
  ks_BHNPCK = k_BHNCK[..., None, :, :] * jnp.exp(expo_BHNPCK)
  A_BHNPLC = jnp.einsum("bhnplk,bhnpck->bhnplc", xs_BHNPLK, ks_BHNPCK, precision=_HI)
  return A_BHNPLC.reshape(B, H, N, C, C)


def _to_chunks(x, chunk_size: int):
  """[B,T,H,...] -> float32 [B,H,N,C,...], zero-padded in time (zero g, beta, k, v keep S unchanged)."""
  B, T = x.shape[:2]
  N = -(-T // chunk_size)
  x = x.astype(jnp.float32)
  x = jnp.pad(x, [(0, 0), (0, N * chunk_size - T)] + [(0, 0)] * (x.ndim - 2))
  x = jnp.moveaxis(x, 2, 1)
  return x.reshape(B, x.shape[1], N, chunk_size, *x.shape[3:])


def _cumsum_in_documents(g_BHNCK, reset_BNC, doc_BNC):
  """In-chunk inclusive cumsum of g where a document that starts inside the chunk sums only its own gates.

  Its rows are offset by the plain cumsum at the document start, so values match the plain cumsum
  (monotone, as the tile bound needs), but the offset carries no gradient: it cancels in every
  difference the document uses. The gate at a document start is irrelevant (it decays a zero state).
  """
  B, H, N, C, K = g_BHNCK.shape
  G_BHNCK = jnp.cumsum(g_BHNCK, axis=-2)
  pos_C = jnp.arange(C)
  own_BNCC = ((doc_BNC[..., :, None] == doc_BNC[..., None, :]) & (pos_C[:, None] >= pos_C[None, :])
              & ~reset_BNC[..., None, :])
  own_BHNCK = jnp.einsum("bnij,bhnjk->bhnik", own_BNCC.astype(jnp.float32), g_BHNCK, precision=_HI)
  start_BNC = jax.lax.cummax(jnp.where(reset_BNC, pos_C, 0), axis=2)
  start_BHNCK = jnp.broadcast_to(start_BNC[:, None, :, :, None], G_BHNCK.shape)
  offset_BHNCK = jnp.take_along_axis(G_BHNCK, start_BHNCK, axis=-2) * (doc_BNC > 0)[:, None, ..., None]
  return jax.lax.stop_gradient(offset_BHNCK) + own_BHNCK


@functools.partial(jax.jit, static_argnames=("chunk_size", "output_final_state"))
def chunk_kda_xla(q, k, v, g, beta, scale, initial_state, reset_BT, *, chunk_size: int,
                  output_final_state: bool):
  """Chunked KDA on validated inputs; `reset_BT` flags document starts after position 0 (or is None)."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  q_BHNCK, k_BHNCK, v_BHNCV, g_BHNCK = (_to_chunks(x, C) for x in (q, k, v, g))
  b_BHNC = _to_chunks(beta, C)
  N = q_BHNCK.shape[2]

  strict_CC = jnp.tril(jnp.ones((C, C), bool), -1)
  incl_CC = jnp.tril(jnp.ones((C, C), bool))
  if reset_BT is None:
    same_doc_B1NCC, carried_B1NC1, last_doc_B1NC1, whole_chunk_B1N1 = True, 1.0, 1.0, 1.0
    G_BHNCK = jnp.cumsum(g_BHNCK, axis=-2)
  else:
    reset_BNC = jnp.pad(reset_BT, ((0, 0), (0, N * C - T))).reshape(B, N, C)
    # doc_BNC[i] = document starts in this chunk at or before i. Rows with doc 0 continue the document
    # the incoming state belongs to; only rows of the chunk's last document feed the outgoing state.
    doc_BNC = jnp.cumsum(reset_BNC, axis=-1, dtype=jnp.int32)
    same_doc_B1NCC = (doc_BNC[..., :, None] == doc_BNC[..., None, :])[:, None]
    carried_B1NC1 = (doc_BNC == 0)[:, None, ..., None]
    last_doc_B1NC1 = (doc_BNC == doc_BNC[..., -1:])[:, None, ..., None]
    whole_chunk_B1N1 = (doc_BNC[..., -1] == 0)[:, None, :, None]
    G_BHNCK = _cumsum_in_documents(g_BHNCK, reset_BNC, doc_BNC)

  A_kk = jnp.where(strict_CC & same_doc_B1NCC,
                   b_BHNC[..., None] * _tiled_scores(k_BHNCK, k_BHNCK, G_BHNCK), 0.0)
  A_qk = jnp.where(incl_CC & same_doc_B1NCC, _tiled_scores(q_BHNCK, k_BHNCK, G_BHNCK), 0.0)

  # M = (I + A_kk)^{-1} Diag(b) applied to [k e^G, v] in one unit-lower-triangular solve.
  eG_BHNCK = jnp.exp(G_BHNCK)
  rhs = b_BHNC[..., None] * jnp.concatenate([k_BHNCK * eG_BHNCK, v_BHNCV], axis=-1)
  WU = solve_triangular(jnp.eye(C) + A_kk, rhs, lower=True, unit_diagonal=True)
  W_BHNCK = WU[..., :K] * carried_B1NC1
  U_BHNCV = WU[..., K:]
  qG_BHNCK = q_BHNCK * eG_BHNCK * carried_B1NC1
  kdec_BHNCK = k_BHNCK * jnp.exp(G_BHNCK[..., -1:, :] - G_BHNCK) * last_doc_B1NC1
  sdec_BHNK = eG_BHNCK[..., -1, :] * whole_chunk_B1N1

  def chunk_step(S_BHKV, x):
    W, U, kdec, sdec = x
    Vp_BHCV = U - jnp.einsum("bhck,bhkv->bhcv", W, S_BHKV, precision=_HI)
    S_next = sdec[..., None] * S_BHKV + jnp.einsum("bhck,bhcv->bhkv", kdec, Vp_BHCV, precision=_HI)
    return S_next, (Vp_BHCV, S_BHKV)

  S0_BHKV = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))
  n_first = lambda x: jnp.moveaxis(x, 2, 0)
  S_BHKV, (Vp_NBHCV, Sin_NBHKV) = jax.lax.scan(
      chunk_step, S0_BHKV, tuple(map(n_first, (W_BHNCK, U_BHNCV, kdec_BHNCK, sdec_BHNK))))
  Vp_BHNCV = jnp.moveaxis(Vp_NBHCV, 0, 2)
  Sin_BHNKV = jnp.moveaxis(Sin_NBHKV, 0, 2)

  o_BHNCV = (jnp.einsum("bhnck,bhnkv->bhncv", qG_BHNCK, Sin_BHNKV, precision=_HI)
             + jnp.einsum("bhnij,bhnjv->bhniv", A_qk, Vp_BHNCV, precision=_HI))
  o_BTHV = jnp.moveaxis((scale * o_BHNCV).reshape(B, H, N * C, V)[:, :, :T], 1, 2)
  return o_BTHV.astype(v.dtype), (S_BHKV if output_final_state else None)
