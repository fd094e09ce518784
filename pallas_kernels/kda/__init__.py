"""Bounded-decay Kimi Delta Attention ops: the chunked op (Pallas kernels on GPU, XLA elsewhere) and the
token-by-token recurrence it must match (DESIGN §2)."""

from pallas_kernels.kda.api import IMPLEMENTATIONS, chunk_kda
from pallas_kernels.kda.recurrent import recurrent_kda

__all__ = ["IMPLEMENTATIONS", "chunk_kda", "recurrent_kda"]
