"""KDA through the Pallas kernels, with a custom VJP (DESIGN §2; kernels in pallas_prep and pallas_scan).

Forward: prep_forward (parallel over chunks) -> scan_forward (sequential over chunks; on Mosaic GPU,
mosaic_scan.scan_forward_mosaic, where Config.scan_lowering picks it).
Backward: scan_backward (reverse sequential; on Mosaic GPU, mosaic_scan_bwd.scan_backward_mosaic, where
Config.scan_lowering picks it) -> state_grads -> prep_backward (both parallel over chunks).
The forward keeps the per-chunk W, qg, kd, A_qk, sdec, V', the state entering each chunk, and the solve
(strict S_kk and Linv, float32 [C,C] per chunk) so that the backward pass does not redo it.
Padding to a whole number of chunks, and of K and V to powers of two (>= 16, as Triton dots need),
happens here; zero k, v, beta and g leave the state unchanged.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.backend import require_gpu
from pallas_kernels.kda import limits, mosaic_scan, mosaic_scan_bwd
from pallas_kernels.kda import pallas_tiles as tiles
from pallas_kernels.kda.pallas_backend import Tuning
from pallas_kernels.kda.pallas_prep import prep_backward, prep_forward, state_grads
from pallas_kernels.kda.pallas_scan import scan_backward, scan_forward


@dataclasses.dataclass(frozen=True)
class Config:
  """Block sizes and launch parameters, set from the H200 measurements in BENCHMARKS.md."""
  block: int = 32               # column block of the backward prep kernel (K and V)
  block_fwd: int | None = None  # and of the forward one (None: the measured default, see `for_chunk`)
  block_grads: int = 64         # and of the state-gradient kernel
  block_v_fwd: int | None = None  # V columns per program of the forward state pass (None: see block_v)
  block_v_bwd: int | None = None  # and of the backward one
  # Launch parameters; None: the measured default for the chunk size (`for_chunk`).
  prep_fwd: Tuning | None = None
  state_grads: Tuning | None = None
  prep_bwd: Tuning | None = None
  scan_fwd: Tuning | None = None
  scan_bwd: Tuning | None = None
  # Lowering of the forward state pass: "triton", "mosaic" (mosaic_scan, wgmma), or None: Mosaic GPU
  # where it applies on the GPU (`scan_lowering`), else Triton. On the H200 (BENCHMARKS.md, "Pallas
  # backend") the Mosaic scan took 0.269 ms against Triton's 0.389 at B=2 T=8192 H=16, chunk 32.
  scan_fwd_lowering: str | None = None
  # And of the backward state pass (mosaic_scan_bwd), chosen the same way: 0.281 ms against 0.447 there.
  scan_bwd_lowering: str | None = None
  mosaic_slots: int = 2         # chunks in flight in the Mosaic scan's TMA ring (2 and 3 timed alike)
  # The forward alone (no gradient taken): the prep kernel merges each pair of chunks into one of twice
  # the size (pallas_tiles_fwd.merge_pair), so that the sequential state pass walks half as many, at
  # the doubled chunk's cost per step. At B=1 that pass is about half of the forward (BENCHMARKS.md,
  # "KDA kernel"). Off: on an H100 it made the forward 13% slower at B=2 T=8192 (0.843 against 0.745
  # ms, session 22) and gained nothing at B=1 (T=32768: 1.945 against 1.948 ms; T=131072: 7.878
  # against 7.761; session 23). A forward kept for the backward pass never merges: the backward reads
  # the state at every chunk.
  merge_chunks: bool = False
  # The forward alone, on the Mosaic lowering: the state pass walks the chunks in this many segments at
  # once and corrects the later segments by their entering states (mosaic_scan_split), for more programs
  # where B * H * V / 32 leaves most of the SMs idle. None: see `segments`.
  scan_segments: int | None = None
  # TMA slots of that segmented pass; None: see `segment_slots_for`.
  segment_slots: int | None = None
  # And its V columns per program (Mosaic; unused where the pass does not segment); None: see
  # `segment_block_v_for`.
  segment_block_v: int | None = None

  def __post_init__(self):
    for name in ("block", "block_fwd", "block_grads", "block_v_fwd", "block_v_bwd", "segment_block_v"):
      n = getattr(self, name)
      if n is not None and (not isinstance(n, int) or n < 16 or n & (n - 1)):
        raise ValueError(f"Config.{name} must be a power of two >= 16 (kernel tiles), got {n!r}")
    if not isinstance(self.merge_chunks, bool):
      raise ValueError(f"Config.merge_chunks must be True or False, got {self.merge_chunks!r}")
    if not isinstance(self.mosaic_slots, int) or self.mosaic_slots < 1:
      raise ValueError(f"Config.mosaic_slots must be a positive int, got {self.mosaic_slots!r}")
    for name in ("scan_segments", "segment_slots"):
      n = getattr(self, name)
      if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"Config.{name} must be None or a positive int, got {n!r}")
    for name in ("scan_fwd_lowering", "scan_bwd_lowering"):
      if getattr(self, name) not in (None, "triton", "mosaic"):
        raise ValueError(f"Config.{name} must be None, 'triton' or 'mosaic', got {getattr(self, name)!r}")

  def for_chunk(self, chunk: int) -> "Config":
    """This config with every unset launch parameter at the H200's best for `chunk` (BENCHMARKS.md,
    "KDA kernel"). Chunks up to 32 take the chunk-32 sweep's winners (2026-12-03: prep_fwd 0.520 ms at
    2 warps against 0.599 at 4, prep_bwd 1.984 at 2 stages against 2.330, the scans 0.391 / 0.453 ms at
    3 stages against 0.557 / 0.573); chunks of 64 keep the settings measured at 64, where the deeper
    pipelines were not tried and need more shared memory. At 128 those asked for 284 KiB of shared
    memory (the H200 has 227), so every kernel runs unpipelined there (correct on the H200, not timed).
    Session 15's sweep of the rewritten prep kernels at chunk 32 (in-kernel gate cumsum, block-wise
    forward): prep_fwd 0.533 ms with 64-column blocks at 2 warps against 0.647 with 32, prep_bwd 1.190 ms
    at 2 warps and 1 stage against 1.499 at 4 warps and 2; other chunks' forward blocks stay at `block`.
    Session 16: with a single column block the forward prep makes G once for scores and W, and
    128-column blocks at 4 warps took it to 0.497 ms (B=2 T=8192 H=16, bf16 gates) and 0.520 ms (the
    step's B=4 H=8, float32 gates), against 0.533 and 0.657 with 64 columns at 2 warps. Session 18's
    whole-chunk forward prep kept both winners: 0.469 ms at 128 columns and 4 warps (0.773-0.998 with
    64 or 32 columns, 0.790 at 8 warps), and at chunk 64 0.880 ms at 32 columns (1.77-4.95 wider)."""
    measured = _AT_32 if chunk <= 32 else _AT_64 if chunk <= 64 else _AT_128
    measured = dict(measured, block_fwd=measured.get("block_fwd", self.block))
    return dataclasses.replace(self, **{name: getattr(self, name) or tuning
                                        for name, tuning in measured.items()})

  def scan_lowering(self, chunk: int, K: int, V: int, store_dtype, interpret: bool = False,
                    backward: bool = False) -> str:
    """The lowering of the forward (or backward) state pass for these shapes; raises if Mosaic was asked
    where it cannot run. In interpret mode the default is Triton: Mosaic GPU's interpreter runs through
    ordered I/O callbacks, which JAX cannot differentiate inside remat (the 1M configs' `model.remat`), so
    it runs only when asked for (as the tests do)."""
    name = "scan_bwd_lowering" if backward else "scan_fwd_lowering"
    chosen = getattr(self, name)
    unsupported = mosaic_scan_bwd.unsupported_backward if backward else mosaic_scan.unsupported
    why = unsupported(K, chunk, self.mosaic_block_v(V, backward), V, store_dtype, self.mosaic_slots)
    if chosen == "mosaic" and why is not None:
      raise ValueError(f"Config.{name}='mosaic' cannot run here: {why}")
    if chosen is not None:
      return chosen
    return "triton" if why is not None or interpret else "mosaic"

  def segments(self, B: int, H: int, K: int, V: int, N: int) -> int:
    """Segments of the forward-only Mosaic state pass (mosaic_scan_split) over N chunks of (padded)
    widths K and V: scan_segments if set, else, where the whole pass has at most 64 programs (half an
    H100's or H200's SMs) and the row at least MIN_SEGMENTED_CHUNKS chunks, the most segments, up to 4,
    whose programs all fit on the SMs at once (`segment_programs`; an SM holds 2 of 64 columns or 3 of
    32, by their registers and shared memory at one slot and K = 128), 2 where not even 3 fit (not
    timed), else 1.

    That rule fits every setting timed. The op's forward at B=1 H=16 K=V=128 on an H100 (session 30,
    ours alone, BENCHMARKS.md "KDA kernel"), ms at T=32768 / 131072, at one slot: 64 columns, 4
    segments (224 programs) 1.549 / 6.032, 5 (288, two waves) 1.821 / 6.974, 3 segments 1.728 /
    6.680, 2 segments 1.833 / 7.232; 32 columns, 3 segments (320 programs) 1.667 / 6.505, 4 (448, two
    waves) 1.954 / 7.631. On an H200 (session 31) the default is again the fastest: 1.495 / 5.856,
    then 32 columns in 3 segments, 1.592 / 6.298. Other widths and head counts were not timed. The
    homogeneous pass's V blocks must divide K (ValueError otherwise, where scan_segments or
    segment_block_v asks for them)."""
    block = self.segment_block_v_for(K, V)
    if self.segment_block_v is not None and K % block:
      raise ValueError(f"Config.segment_block_v={self.segment_block_v} must divide the key width {K}")
    if self.scan_segments is not None:
      if self.scan_segments > 1 and K % block:
        raise ValueError(f"Config.scan_segments={self.scan_segments} needs V blocks that divide K: "
                         f"{block} and {K}")
      return self.scan_segments
    fits = (B * H * (V // self.mosaic_block_v(V)) <= 64 and N >= MIN_SEGMENTED_CHUNKS
            and K % block == 0)
    if not fits:
      return 1
    resident = SMS * (2 if block >= 64 else 3)
    return next((P for P in (4, 3) if segment_programs(B, H, K, V, block, P) <= resident), 2)

  def segment_block_v_for(self, K: int, V: int) -> int:
    """V columns per program of the segmented forward pass: segment_block_v if set, else block_v_fwd
    if set, else 64 where 64 divides K and V (the homogeneous programs walk K in V blocks), else the
    scans' own (mosaic_block_v). Against 32 columns, 64 halve the programs that each read a chunk's W,
    qg and kd, and take wgmmas twice as wide (see `segments` for the timings)."""
    chosen = self.segment_block_v or self.block_v_fwd
    if chosen is not None:
      return min(chosen, V)
    return 64 if K % 64 == 0 and V % 64 == 0 else self.mosaic_block_v(V)

  def segment_slots_for(self, segments: int) -> int:
    """TMA slots of the segmented forward pass: segment_slots if set, else 1 from 3 segments on and
    mosaic_slots below. At K = 128 and chunk 32 a program then needs 53 KiB of shared memory instead of
    85 with 32-column V blocks, and 77 instead of 113 with 64, so that an SM holds as many as their
    registers allow (3 and 2) instead of 2 and 1. On the H200 at T=131072 the 3-segment kernel of 32
    columns alone took 2.57 ms at one slot against the 2-segment one's 3.23 at two (session 29, an
    ad-hoc probe)."""
    if self.segment_slots is not None:
      return self.segment_slots
    return 1 if segments >= 3 else self.mosaic_slots

  def mosaic_block_v(self, V: int, backward: bool = False) -> int:
    """The Mosaic scans' V block: 32 columns, at every batch size. 16 took 1.8x as long in the forward at
    B=2 T=8192 H=16, chunk 32; at B=1, where 16 doubles the programs from 64 to 128 for the H200's 132
    SMs, the whole op was still slower with it (T=32768: forward 2.003 ms against 1.935, 16 in both
    passes 1.979 / 6.549 against 1.935 / 6.331; session 23 on an H200)."""
    return min((self.block_v_bwd if backward else self.block_v_fwd) or 32, V)

  def block_v(self, chosen, B: int, H: int, V: int) -> int:
    """The scans' V block: 32 columns per program unless that leaves fewer than 128 programs (the
    H200 has 132 SMs and the scan is latency-bound), then 16."""
    if chosen is None:
      chosen = 32 if B * H * (V // 32) >= 128 else 16
    return min(chosen, V)


# Streaming multiprocessors of an H100 (SXM) or H200, for which the segments' defaults were timed.
SMS = 132


def segment_programs(B: int, H: int, K: int, V: int, block_v: int, segments: int) -> int:
  """Programs of the segmented forward pass: per row and head, V / block_v for segment 0 and
  (V + K) / block_v (its homogeneous pass too) for each later one."""
  return B * H * (V // block_v + (segments - 1) * ((V + K) // block_v))


# Rows shorter than this keep one forward state pass by default: segments were timed at 1024 and 4096
# chunks; at a few chunks the extra kernels and the padding to whole segments weigh more.
MIN_SEGMENTED_CHUNKS = 256

_AT_32 = dict(prep_fwd=Tuning(4, 1), block_fwd=128, state_grads=Tuning(4, 1), prep_bwd=Tuning(2, 1),
              scan_fwd=Tuning(4, 3), scan_bwd=Tuning(4, 3))
_AT_64 = dict(prep_fwd=Tuning(4, 1), state_grads=Tuning(4, 1), prep_bwd=Tuning(4, 1), scan_fwd=Tuning(4, 2),
              scan_bwd=Tuning(4, 2))
_AT_128 = dict(prep_fwd=Tuning(4, 1), state_grads=Tuning(4, 1), prep_bwd=Tuning(4, 1), scan_fwd=Tuning(4, 1),
               scan_bwd=Tuning(4, 1))


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
    o, S_fin, states, Vp = mosaic_scan.scan_forward_mosaic(
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
    dVp, dS_next, dS0 = mosaic_scan_bwd.scan_backward_mosaic(
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
  """KDA on validated inputs (see api.chunk_kda); `reset_BT` flags document starts after position 0
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
    why = mosaic_scan.unsupported(Kp, scan_at[1], segment_block_v, Vp, store_dtype, slots)
    if why is not None:
      raise ValueError(f"the forward's state pass cannot run in {segments} segments of {segment_block_v} "
                       f"columns at {slots} slots: {why}")
  st = _Static(chunk=C, scale=s, prec=tiles.precision_for(store_dtype), store_dtype=store_dtype,
               out_dtype=jnp.dtype(v.dtype), interpret=bool(interpret), cfg=cfg, scan_cfg=scan_cfg,
               segments=segments, segment_slots=slots, segment_block_v=segment_block_v)

  # Whole pairs of chunks to merge, and a chunk (or pair) for every segment: padded chunks' zero k, v,
  # beta and g leave the state as it is.
  pair = 2 if config.merge_chunks else 1
  N = mosaic_scan.segmented_chunks(-(-T // (C * pair)), segments, scan_at[1]) * pair
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
