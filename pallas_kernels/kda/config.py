"""The Pallas KDA op's configuration: block sizes, launch parameters, the state passes' lowering, V blocks
and segments. Unset fields take the measured defaults of tuning.py, by the rules in the methods below.
"""

import dataclasses

from pallas_kernels.kda import tuning
from pallas_kernels.kda.lowering import Tuning
from pallas_kernels.kda.mosaic.scan_backward import unsupported_backward
from pallas_kernels.kda.mosaic.scan_forward import unsupported


@dataclasses.dataclass(frozen=True)
class Config:
  """Block sizes and launch parameters; defaults from tuning.py."""
  block: int = tuning.PREP_BLOCK  # column block of the backward prep kernel (K and V)
  block_fwd: int | None = None  # and of the forward one (None: the measured default, see `for_chunk`)
  block_grads: int = tuning.STATE_GRADS_BLOCK  # and of the state-gradient kernel
  block_v_fwd: int | None = None  # V columns per program of the forward state pass (None: see block_v)
  block_v_bwd: int | None = None  # and of the backward one
  # Launch parameters; None: the measured default for the chunk size (`for_chunk`).
  prep_fwd: Tuning | None = None
  state_grads: Tuning | None = None
  prep_bwd: Tuning | None = None
  scan_fwd: Tuning | None = None
  scan_bwd: Tuning | None = None
  # Lowering of the forward state pass: "triton", "mosaic" (mosaic.scan_forward, wgmma), or None:
  # tuning.SCAN_LOWERING where Mosaic GPU applies on the GPU (`scan_lowering`), else Triton.
  scan_fwd_lowering: str | None = None
  # And of the backward state pass (mosaic.scan_backward), chosen the same way.
  scan_bwd_lowering: str | None = None
  mosaic_slots: int = tuning.MOSAIC_SLOTS  # chunks in flight in the Mosaic scans' TMA ring
  # The forward alone (no gradient taken): the prep kernel merges each pair of chunks into one of twice
  # the size (forward.merge_pair), so that the sequential state pass walks half as many, at the doubled
  # chunk's cost per step. At B=1 that pass is about half of the forward; off by default, as it measured
  # slower (tuning.MERGE_CHUNKS). A forward kept for the backward pass never merges: the backward reads
  # the state at every chunk.
  merge_chunks: bool = tuning.MERGE_CHUNKS
  # The forward alone, on the Mosaic lowering: the state pass walks the chunks in this many segments at
  # once and corrects the later segments by their entering states (mosaic.scan_segmented), for more
  # programs where B * H * V / 32 leaves most of the SMs idle. None: see `segments`.
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
    """This config with every unset launch parameter at its measured default for `chunk`
    (tuning.AT_CHUNK_32, _64 or _128: chunks up to 32, up to 64, larger); the forward prep's column block
    where those set none stays at `block`."""
    measured = (tuning.AT_CHUNK_32 if chunk <= 32 else tuning.AT_CHUNK_64 if chunk <= 64
                else tuning.AT_CHUNK_128)
    measured = dict(measured, block_fwd=measured.get("block_fwd", self.block))
    return dataclasses.replace(self, **{name: getattr(self, name) or value
                                        for name, value in measured.items()})

  def scan_lowering(self, chunk: int, K: int, V: int, store_dtype, interpret: bool = False,
                    backward: bool = False) -> str:
    """The lowering of the forward (or backward) state pass for these shapes; raises if Mosaic was asked
    where it cannot run. In interpret mode the default is Triton: Mosaic GPU's interpreter runs through
    ordered I/O callbacks, which JAX cannot differentiate inside remat (the 1M configs' `model.remat`), so
    it runs only when asked for (as the tests do)."""
    name = "scan_bwd_lowering" if backward else "scan_fwd_lowering"
    chosen = getattr(self, name)
    why = (unsupported_backward if backward else unsupported)(K, chunk, self.mosaic_block_v(V, backward), V,
                                                              store_dtype, self.mosaic_slots)
    if chosen == "mosaic" and why is not None:
      raise ValueError(f"Config.{name}='mosaic' cannot run here: {why}")
    if chosen is not None:
      return chosen
    return "triton" if why is not None or interpret else tuning.SCAN_LOWERING

  def segments(self, B: int, H: int, K: int, V: int, N: int) -> int:
    """Segments of the forward-only Mosaic state pass (mosaic.scan_segmented) over N chunks of (padded)
    widths K and V: scan_segments if set, else, where the whole pass has at most
    tuning.SEGMENTED_MAX_PROGRAMS programs (64, half an H100's or H200's SMs) and the row at least
    tuning.MIN_SEGMENTED_CHUNKS chunks, the most segments, up to tuning.MAX_SEGMENTS (4), whose programs
    all fit on the SMs at once (`segment_programs`; an SM holds 2 of 64 columns or 3 of 32, by their
    registers and shared memory at one slot and K = 128), tuning.FALLBACK_SEGMENTS (2) where not even 3
    fit, else 1.

    That rule fits every setting timed (BENCHMARKS.md, "KDA kernel": what sets the segment rule, on an
    H100, and the segmented forward defaults, on an H200); other widths and head counts were not timed.
    The homogeneous pass's V blocks must divide K (ValueError otherwise, where scan_segments or
    segment_block_v asks for them)."""
    block = self.segment_block_v_for(K, V)
    if self.segment_block_v is not None and K % block:
      raise ValueError(f"Config.segment_block_v={self.segment_block_v} must divide the key width {K}")
    if self.scan_segments is not None:
      if self.scan_segments > 1 and K % block:
        raise ValueError(f"Config.scan_segments={self.scan_segments} needs V blocks that divide K: "
                         f"{block} and {K}")
      return self.scan_segments
    fits = (B * H * (V // self.mosaic_block_v(V)) <= tuning.SEGMENTED_MAX_PROGRAMS
            and N >= tuning.MIN_SEGMENTED_CHUNKS and K % block == 0)
    if not fits:
      return 1
    resident = tuning.SMS * (tuning.PROGRAMS_PER_SM_WIDE if block >= 64 else tuning.PROGRAMS_PER_SM_NARROW)
    return next((P for P in range(tuning.MAX_SEGMENTS, 2, -1)
                 if segment_programs(B, H, K, V, block, P) <= resident), tuning.FALLBACK_SEGMENTS)

  def segment_block_v_for(self, K: int, V: int) -> int:
    """V columns per program of the segmented forward pass: segment_block_v if set, else block_v_fwd
    if set, else tuning.SEGMENT_BLOCK_V (64) where it divides K and V (the homogeneous programs walk K in
    V blocks), else the scans' own (mosaic_block_v)."""
    chosen = self.segment_block_v or self.block_v_fwd
    if chosen is not None:
      return min(chosen, V)
    wide = tuning.SEGMENT_BLOCK_V
    return wide if K % wide == 0 and V % wide == 0 else self.mosaic_block_v(V)

  def segment_slots_for(self, segments: int) -> int:
    """TMA slots of the segmented forward pass: segment_slots if set, else 1 from
    tuning.ONE_SLOT_SEGMENTS (3) segments on and mosaic_slots below (tuning.py says why)."""
    if self.segment_slots is not None:
      return self.segment_slots
    return 1 if segments >= tuning.ONE_SLOT_SEGMENTS else self.mosaic_slots

  def mosaic_block_v(self, V: int, backward: bool = False) -> int:
    """The Mosaic scans' V block: block_v_bwd or block_v_fwd if set, else tuning.MOSAIC_BLOCK_V (32
    columns) at every batch size."""
    return min((self.block_v_bwd if backward else self.block_v_fwd) or tuning.MOSAIC_BLOCK_V, V)

  def block_v(self, chosen, B: int, H: int, V: int) -> int:
    """The Triton scans' V block: `chosen` if set, else tuning.TRITON_BLOCK_V (32) columns per program
    unless that leaves fewer than tuning.TRITON_MIN_PROGRAMS (128) programs (the H200 has 132 SMs and the
    scan is latency-bound), then tuning.TRITON_NARROW_BLOCK_V (16)."""
    if chosen is None:
      wide = tuning.TRITON_BLOCK_V
      chosen = wide if B * H * (V // wide) >= tuning.TRITON_MIN_PROGRAMS else tuning.TRITON_NARROW_BLOCK_V
    return min(chosen, V)


def segment_programs(B: int, H: int, K: int, V: int, block_v: int, segments: int) -> int:
  """Programs of the segmented forward pass: per row and head, V / block_v for segment 0 and
  (V + K) / block_v (its homogeneous pass too) for each later one."""
  return B * H * (V // block_v + (segments - 1) * ((V + K) // block_v))
