"""Newton-Schulz's symmetric products (Muon): reference and Pallas kernel."""

from pallas_kernels.newton_schulz.kernel import GRAM_BLOCKS, POLY_BLOCKS, Blocks
from pallas_kernels.newton_schulz.ops import IMPLEMENTATIONS, gram_poly
from pallas_kernels.newton_schulz.reference import gram_poly as gram_poly_reference

__all__ = ["GRAM_BLOCKS", "IMPLEMENTATIONS", "POLY_BLOCKS", "Blocks", "gram_poly", "gram_poly_reference"]
