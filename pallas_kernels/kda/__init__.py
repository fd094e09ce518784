"""Bounded-decay Kimi Delta Attention ops: the chunked op (Pallas kernels on GPU, XLA elsewhere) and the
token-by-token recurrence it must match (docs/design.md §2).

ops.py: the public op and the Pallas path's custom VJP; config.py and tuning.py: its settings and their
measured defaults; forward.py, backward.py: the chunk-parallel kernels; scan.py: the sequential state
pass (Triton; mosaic/ holds its Mosaic GPU ports); tiles.py: per-chunk math both sides share;
lowering.py: the Triton launch and dot helpers; recurrent.py: the token-by-token recurrence;
reference.py: the pure-JAX chunked form the kernels must match; inputs.py, limits.py: checks.
"""

from pallas_kernels.kda.config import Config
from pallas_kernels.kda.ops import IMPLEMENTATIONS, chunk_kda, chunk_kda_pallas
from pallas_kernels.kda.recurrent import recurrent_kda

__all__ = ["IMPLEMENTATIONS", "Config", "chunk_kda", "chunk_kda_pallas", "recurrent_kda"]
