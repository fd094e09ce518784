"""Public KDA entry point: validates inputs once and picks an implementation."""

import jax
import jax.numpy as jnp

from pallas_kernels.kda.chunk_xla import TILE, chunk_kda_xla
from pallas_kernels.kda.inputs import check_inputs, resets, resolve_scale
from pallas_kernels.kda.pallas_op import chunk_kda_pallas
from pallas_kernels.kda.recurrent import recurrent_kda

IMPLEMENTATIONS = ("xla", "recurrent", "pallas", "interpret")


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              segment_ids=None, chunk_size=32, implementation=None):
  """Bounded-decay Kimi Delta Attention over whole sequences (DESIGN §2).

  Per head, with state S in R^{K x V}:
    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,   o_t = scale * S_t^T q_t.

  Args:
    q, k: [B,T,H,K]. v: [B,T,H,V]. g: [B,T,H,K] log-decay, already bounded in [lb, 0) with lb >= -5
      (the caller applies the gate; the chunked form relies on the bound and does not check it).
    beta: [B,T,H] in (0, 1).
    scale: output scale, default K**-0.5.
    initial_state: optional [B,H,K,V] state before position 0 (float32 recommended).
    output_final_state: also return the state after the last position.
    segment_ids: optional [B,T] int. A new document starts wherever the id changes from the previous
      position. The state restarts (from zero) at every document start after position 0 and nothing
      crosses a document boundary. initial_state applies to the first document of each row only, and
      the final state is the state at the end of the row, i.e. of its last document. Outputs and
      gradients of one document do not depend on any other document (cross-document gradients are
      exact zeros, not just small).
    chunk_size: inter-chunk scan length; a positive multiple of 16 (a power of two up to 128 for the
      Pallas kernel, 128 only with K and V up to 128). T need not divide by it.
    implementation: None ("pallas" on GPU, "xla" elsewhere), "xla" (chunked matmul form), "recurrent"
      (token-by-token lax.scan), "pallas" (Pallas GPU kernels), "interpret" (the same kernels in Pallas
      interpret mode, e.g. on CPU).

  Returns:
    (o [B,T,H,V] in v's dtype, final_state [B,H,K,V] float32 if output_final_state else None).
    All accumulation is float32 whatever the input dtype.
  """
  if implementation is None:
    implementation = "pallas" if jax.default_backend() == "gpu" else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown KDA implementation {implementation!r}; expected one of {IMPLEMENTATIONS}"
                     " or None")
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0 \
      or chunk_size % TILE:
    raise ValueError(f"chunk_size must be a positive multiple of {TILE}, got {chunk_size!r}")
  if implementation == "recurrent":
    return recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, segment_ids=segment_ids)
  K = check_inputs(q, k, v, g, beta, initial_state, segment_ids).K
  if implementation in ("pallas", "interpret"):
    return chunk_kda_pallas(q, k, v, g, beta, resolve_scale(scale, K), initial_state, resets(segment_ids),
                            chunk_size=chunk_size, output_final_state=bool(output_final_state),
                            interpret=implementation == "interpret")
  scale = jnp.asarray(resolve_scale(scale, K), jnp.float32)
  return chunk_kda_xla(q, k, v, g, beta, scale, initial_state, resets(segment_ids),
                       chunk_size=chunk_size, output_final_state=bool(output_final_state))
