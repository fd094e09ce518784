"""Grouped (ragged) matmul for dropless MoE experts: Pallas GPU kernels beside the XLA form
(docs/design.md §5)."""

from pallas_kernels.gmm.ops import IMPLEMENTATIONS, gmm
from pallas_kernels.gmm.reference import gmm_xla, tgmm_xla
from pallas_kernels.gmm.tiling import DEFAULT_TILING, Tile, Tiling

__all__ = ["DEFAULT_TILING", "IMPLEMENTATIONS", "Tile", "Tiling", "gmm", "gmm_xla", "tgmm_xla"]
