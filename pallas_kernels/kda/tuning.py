"""Measured defaults of the Pallas KDA op, as data: block sizes, launch parameters, the state pass's
lowering, V blocks and segments. config.Config reads them where a field is left unset; each names the
BENCHMARKS.md section that measured it (on an H100 or H200), and config.py says how they combine.
"""

from pallas_kernels.kda.lowering import Tuning

# Launch parameters (num_warps, num_stages) per kernel, and the forward prep's column block, by chunk
# size: chunks up to 32 take the chunk-32 sweep's winners; chunks of 64 the settings measured at 64,
# where the deeper pipelines were not tried and need more shared memory; at 128 every kernel runs
# unpipelined, since pipelined ones asked for more shared memory than the H200 has (correct, not timed).
# BENCHMARKS.md, "KDA kernel" (launch parameters at chunk 32)
AT_CHUNK_32 = dict(prep_fwd=Tuning(4, 1), block_fwd=128, state_grads=Tuning(4, 1), prep_bwd=Tuning(2, 1),
                   scan_fwd=Tuning(4, 3), scan_bwd=Tuning(4, 3))
# BENCHMARKS.md, "KDA kernel" (forward prep as whole-chunk dots, at chunk 64)
AT_CHUNK_64 = dict(prep_fwd=Tuning(4, 1), state_grads=Tuning(4, 1), prep_bwd=Tuning(4, 1),
                   scan_fwd=Tuning(4, 2), scan_bwd=Tuning(4, 2))
# Not timed: the smallest pipelines, which fit shared memory.
AT_CHUNK_128 = dict(prep_fwd=Tuning(4, 1), state_grads=Tuning(4, 1), prep_bwd=Tuning(4, 1),
                    scan_fwd=Tuning(4, 1), scan_bwd=Tuning(4, 1))

# Column block of the backward prep kernel (K and V), and of the forward one where AT_CHUNK_* sets none.
# BENCHMARKS.md, "KDA kernel" and "KDA kernels' registers (ptxas, no GPU)"
PREP_BLOCK = 32
# Column block of the state-gradient kernel. BENCHMARKS.md, "KDA kernels' registers (ptxas, no GPU)"
STATE_GRADS_BLOCK = 64

# Lowering of the state passes where the Mosaic GPU ports apply (bf16 data, K a multiple of 64, the
# slot ring within shared memory); Triton elsewhere. BENCHMARKS.md, "Pallas backend: Triton vs Mosaic GPU"
SCAN_LOWERING = "mosaic"
# Chunks in flight in the Mosaic scans' TMA ring (2 and 3 timed alike).
# BENCHMARKS.md, "Pallas backend: Triton vs Mosaic GPU"
MOSAIC_SLOTS = 2
# V columns per program of the Mosaic scans, at every batch size: 16 is slower, even at B=1 where it
# doubles the programs. BENCHMARKS.md, "Pallas backend: Triton vs Mosaic GPU" and "KDA kernel"
MOSAIC_BLOCK_V = 32
# V columns per program of the Triton scans: the wide block unless that leaves fewer than
# TRITON_MIN_PROGRAMS programs (the scan is latency-bound; 132 SMs), then the narrow one.
# BENCHMARKS.md, "Pallas backend: Triton vs Mosaic GPU"
TRITON_BLOCK_V = 32
TRITON_NARROW_BLOCK_V = 16
TRITON_MIN_PROGRAMS = 128

# The forward alone: merge each pair of chunks in the prep kernel so that the state pass walks half as
# many. Off: slower at B=2, no gain at B=1. BENCHMARKS.md, "KDA kernel" (tried, slower)
MERGE_CHUNKS = False

# The forward alone on the Mosaic lowering, walked in segments where the whole pass has at most
# SEGMENTED_MAX_PROGRAMS programs (half the SMs) and the row at least MIN_SEGMENTED_CHUNKS chunks
# (segments were timed at 1024 and 4096 chunks; at a few the extra kernels and the padding to whole
# segments weigh more): the most segments, up to MAX_SEGMENTS, whose programs all fit on the SMS
# streaming multiprocessors at once, PROGRAMS_PER_SM_WIDE of 64 or more columns per SM and
# PROGRAMS_PER_SM_NARROW of fewer (by registers and shared memory at one slot, K = 128), else
# FALLBACK_SEGMENTS (not timed).
# BENCHMARKS.md, "KDA kernel" (what sets the segment rule; segmented forward defaults)
SEGMENTED_MAX_PROGRAMS = 64
MIN_SEGMENTED_CHUNKS = 256
MAX_SEGMENTS = 4
FALLBACK_SEGMENTS = 2
SMS = 132  # an H100 (SXM) or H200, on which the segment defaults were timed
PROGRAMS_PER_SM_WIDE = 2
PROGRAMS_PER_SM_NARROW = 3
# V columns per program of the segmented pass, where they divide K and V (the homogeneous programs walk
# K in V blocks): half the programs of 32 columns, each reading a chunk's W, qg and kd, and wgmmas twice
# as wide. BENCHMARKS.md, "KDA kernel" (segmented forward defaults)
SEGMENT_BLOCK_V = 64
# One TMA slot for the segmented pass from ONE_SLOT_SEGMENTS segments on (fewer segments: MOSAIC_SLOTS):
# at K = 128 and chunk 32 a program then needs 53 KiB of shared memory instead of 85 with 32-column V
# blocks, and 77 instead of 113 with 64, so that an SM holds as many as their registers allow (3 and 2)
# instead of 2 and 1. BENCHMARKS.md, "KDA kernel" (segmented forward defaults)
ONE_SLOT_SEGMENTS = 3
