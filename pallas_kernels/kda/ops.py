"""The KDA op: the public entry point `chunk_kda`, which validates inputs once and picks an
implementation, and the Pallas path `chunk_kda_pallas` with its custom VJP (docs/design.md §2).

Pallas forward: forward.prep_forward (parallel over chunks) -> scan.scan_forward (sequential over chunks;
on Mosaic GPU, mosaic.scan_forward.scan_forward_mosaic, where Config.scan_lowering picks it).
Pallas backward: scan.scan_backward (reverse sequential; on Mosaic GPU,
mosaic.scan_backward.scan_backward_mosaic, where Config.scan_lowering picks it) -> backward.state_grads
-> backward.prep_backward (both parallel over chunks).
The forward keeps the per-chunk W, qg, kd, A_qk, sdec, V', the state entering each chunk, and the solve
(strict S_kk and Linv, float32 [C,C] per chunk) so that the backward pass does not redo it.
Padding to a whole number of chunks, and of K and V to powers of two (>= 16, as Triton dots need),
happens in chunk_kda_pallas; zero k, v, beta and g leave the state unchanged.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.backend import require_gpu
from pallas_kernels.kda import limits, tiles
from pallas_kernels.kda.backward import prep_backward, state_grads
from pallas_kernels.kda.config import Config
from pallas_kernels.kda.forward import prep_forward
from pallas_kernels.kda.inputs import check_inputs, resets, resolve_scale
from pallas_kernels.kda.mosaic.scan_backward import scan_backward_mosaic
from pallas_kernels.kda.mosaic.scan_forward import scan_forward_mosaic, unsupported
from pallas_kernels.kda.mosaic.scan_segmented import segmented_chunks
from pallas_kernels.kda.recurrent import recurrent_kda
from pallas_kernels.kda.reference import TILE, chunk_kda_xla
from pallas_kernels.kda.scan import scan_backward, scan_forward

IMPLEMENTATIONS = ("xla", "recurrent", "pallas", "interpret")


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              segment_ids=None, chunk_size=32, implementation=None):
  """Bounded-decay Kimi Delta Attention over whole sequences (docs/design.md §2).

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


@dataclasses.dataclass(frozen=True)
class _Static:
  chunk: int
  scale: float
  prec: tiles.Precision
  store_dtype: jnp.dtype
  out_dtype: jnp.dtype
  interpret: bool
  cfg: Config
  scan_cfg: Config | None = None  # with merge_chunks: the config at the state pass's doubled chunk
  segments: int = 1  # of the forward-only Mosaic state pass (Config.segments)
  segment_slots: int = 0  # and its TMA slots where segments > 1 (Config.segment_slots_for)
  segment_block_v: int = 0  # and its V block (Config.segment_block_v_for)

  def block(self, *widths):
    return min(self.cfg.block, *widths)

  def block_fwd(self, *widths):
    return min(self.cfg.block_fwd, *widths)


def _forward(st: _Static, q, k, v, g, beta, S0, doc, keep: bool):
  K, V = q.shape[-1], v.shape[-1]
  merge = st.scan_cfg is not None and not keep
  W, U, qg, kd, Aqk, sdec, *solve = prep_forward(q, k, v, g, beta, doc, chunk=st.chunk,
                                                 block=st.block_fwd(K, V), scale=st.scale, prec=st.prec,
                                                 store_dtype=st.store_dtype, interpret=st.interpret,
                                                 tuning=st.cfg.prep_fwd, keep_solve=keep, merge_pairs=merge)
  states_dtype = st.store_dtype if keep else None
  scan_cfg, scan_chunk = (st.scan_cfg, 2 * st.chunk) if merge else (st.cfg, st.chunk)
  if scan_cfg.scan_lowering(scan_chunk, K, V, st.store_dtype, st.interpret) == "mosaic":
    segmented = not keep and st.segments > 1  # a forward kept for the backward walks every chunk
    o, S_fin, states, Vp = scan_forward_mosaic(
        W, U, qg, kd, Aqk, sdec, S0, out_dtype=st.out_dtype,
        block_v=st.segment_block_v if segmented else scan_cfg.mosaic_block_v(V),
        stages=st.segment_slots if segmented else scan_cfg.mosaic_slots,
        states_dtype=states_dtype, interpret=st.interpret, segments=st.segments if segmented else 1)
  else:
    block_v = scan_cfg.block_v(scan_cfg.block_v_fwd, q.shape[0], q.shape[2], V)
    o, S_fin, states, Vp = scan_forward(W, U, qg, kd, Aqk, sdec, S0, out_dtype=st.out_dtype, block_v=block_v,
                                        big=st.prec.big, states_dtype=states_dtype, interpret=st.interpret,
                                        tuning=scan_cfg.scan_fwd)
  return (o, S_fin), (q, k, v, g, beta, doc, W, qg, kd, Aqk, sdec, states, Vp, *solve)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(st: _Static, q, k, v, g, beta, S0, doc):
  return _forward(st, q, k, v, g, beta, S0, doc, keep=False)[0]


def _kda_fwd(st, q, k, v, g, beta, S0, doc):
  return _forward(st, q, k, v, g, beta, S0, doc, keep=True)


def _kda_bwd(st, res, cts):
  q, k, v, g, beta, doc, W, qg, kd, Aqk, sdec, states, Vp, A, Linv = res
  dO, dS_fin = cts
  K, V = q.shape[-1], v.shape[-1]
  dO = dO.astype(st.store_dtype)
  if st.cfg.scan_lowering(st.chunk, K, V, st.store_dtype, st.interpret, backward=True) == "mosaic":
    dVp, dS_next, dS0 = scan_backward_mosaic(
        dO, Aqk, kd, W, qg, sdec, dS_fin.astype(jnp.float32), store_dtype=st.store_dtype,
        block_v=st.cfg.mosaic_block_v(V, backward=True), stages=st.cfg.mosaic_slots,
        interpret=st.interpret)
  else:
    dVp, dS_next, dS0 = scan_backward(dO, Aqk, kd, W, qg, sdec, dS_fin.astype(jnp.float32),
                                      store_dtype=st.store_dtype,
                                      block_v=st.cfg.block_v(st.cfg.block_v_bwd, q.shape[0], q.shape[2], V),
                                      big=st.prec.big, interpret=st.interpret, tuning=st.cfg.scan_bwd)
  dW, dqg, dkd, dAqk, dsdec = state_grads(states, dS_next, dO, dVp, Vp, block=min(st.cfg.block_grads, K, V),
                                          prec=st.prec,
                                          store_dtype=st.store_dtype, interpret=st.interpret,
                                          tuning=st.cfg.state_grads)
  dq, dk, dv, dg, dbeta = prep_backward(q, k, v, g, beta, doc, A, Linv, dW, dVp, dqg, dkd, dAqk, dsdec,
                                        chunk=st.chunk, block=st.block(K, V), scale=st.scale, prec=st.prec,
                                        interpret=st.interpret, tuning=st.cfg.prep_bwd)
  return dq, dk, dv, dg, dbeta, dS0, None


_kda.defvjp(_kda_fwd, _kda_bwd)
# One jitted function for every KDA layer of a model: traced, differentiated and lowered once.
_kda_jit = jax.jit(_kda, static_argnums=0)


def _static_scale(scale):
  """The scale as a Python float when it is concrete, else None (then it is folded into q)."""
  try:
    return float(scale)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def chunk_kda_pallas(q, k, v, g, beta, scale, initial_state, reset_BT, *, chunk_size: int,
                     output_final_state: bool, interpret: bool, config: Config | None = None):
  """KDA on validated inputs (see chunk_kda); `reset_BT` flags document starts after position 0
  (None: one document per row).

  Data in bf16 runs bf16 dots with float32 accumulation and state; any float32 operand among q, k, v
  makes every product exact float32.
  """
  if not interpret:
    require_gpu("chunk_kda")
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = chunk_size
  if (why := limits.unsupported(C, K, V)) is not None:
    raise ValueError(why)
  config = Config() if config is None else config
  if config.merge_chunks and (why := limits.unsupported(2 * C, K, V)) is not None:
    raise ValueError(f"Config.merge_chunks runs the state pass at chunk {2 * C}, which cannot: {why}")
  cfg = config.for_chunk(C)
  scan_cfg = config.for_chunk(2 * C) if config.merge_chunks else None
  f32_mode = any(jnp.dtype(x.dtype).itemsize >= 4 for x in (q, k, v))
  store_dtype = jnp.dtype(jnp.float32 if f32_mode else jnp.bfloat16)
  s = _static_scale(scale)
  if s is None:
    q, s = q * scale, 1.0
  Kp, Vp = limits.padded_width(K), limits.padded_width(V)
  # Segments where the forward's state pass runs on Mosaic (the Triton pass has its own V blocks).
  scan_at = (scan_cfg, 2 * C) if config.merge_chunks else (cfg, C)
  mosaic = scan_at[0].scan_lowering(scan_at[1], Kp, Vp, store_dtype, interpret) == "mosaic"
  segments = config.segments(B, H, Kp, Vp, -(-T // scan_at[1])) if mosaic else 1
  slots = segment_block_v = 0
  if segments > 1:
    slots, segment_block_v = scan_at[0].segment_slots_for(segments), scan_at[0].segment_block_v_for(Kp, Vp)
    why = unsupported(Kp, scan_at[1], segment_block_v, Vp, store_dtype, slots)
    if why is not None:
      raise ValueError(f"the forward's state pass cannot run in {segments} segments of {segment_block_v} "
                       f"columns at {slots} slots: {why}")
  st = _Static(chunk=C, scale=s, prec=tiles.precision_for(store_dtype), store_dtype=store_dtype,
               out_dtype=jnp.dtype(v.dtype), interpret=bool(interpret), cfg=cfg, scan_cfg=scan_cfg,
               segments=segments, segment_slots=slots, segment_block_v=segment_block_v)

  # Whole pairs of chunks to merge, and a chunk (or pair) for every segment: padded chunks' zero k, v,
  # beta and g leave the state as it is.
  pair = 2 if config.merge_chunks else 1
  N = segmented_chunks(-(-T // (C * pair)), segments, scan_at[1]) * pair
  pad = lambda x, width: jnp.pad(x, [(0, 0), (0, N * C - T), (0, 0), (0, width - x.shape[-1])])
  qp, kp, gp = (pad(x.astype(store_dtype) if x is not g else x, Kp) for x in (q, k, g))
  vp = pad(v.astype(store_dtype), Vp)
  betap = jnp.pad(beta, [(0, 0), (0, N * C - T), (0, 0)])
  if reset_BT is None:
    doc = jnp.zeros((B, N * C), jnp.int32)
  else:
    # Per row: 2 * (documents started in its chunk up to it) + (one starts at it).
    reset_BNC = jnp.pad(reset_BT, [(0, 0), (0, N * C - T)]).reshape(B, N, C).astype(jnp.int32)
    doc = (2 * jnp.cumsum(reset_BNC, axis=-1, dtype=jnp.int32) + reset_BNC).reshape(B, N * C)
  S0 = (jnp.zeros((B, H, Kp, Vp), jnp.float32) if initial_state is None else
        jnp.pad(initial_state.astype(jnp.float32), [(0, 0), (0, 0), (0, Kp - K), (0, Vp - V)]))

  o, S_fin = _kda_jit(st, qp, kp, vp, gp, betap, S0, doc)
  o = o[:, :T, :, :V]
  return o, (S_fin[:, :, :K, :V] if output_final_state else None)
