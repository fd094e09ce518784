"""Bounded-decay Kimi Delta Attention ops: pure-JAX references, later the Pallas kernel (DESIGN §2)."""

from pallas_kernels.kda.api import IMPLEMENTATIONS, chunk_kda
from pallas_kernels.kda.recurrent import recurrent_kda

__all__ = ["IMPLEMENTATIONS", "chunk_kda", "recurrent_kda"]
