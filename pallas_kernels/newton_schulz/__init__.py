"""Newton-Schulz's symmetric products (Muon): reference and Pallas kernel."""

from pallas_kernels.newton_schulz.kernel import Blocks
from pallas_kernels.newton_schulz.ops import IMPLEMENTATIONS, gram_poly
from pallas_kernels.newton_schulz.reference import gram_poly as gram_poly_reference

__all__ = ["IMPLEMENTATIONS", "Blocks", "gram_poly", "gram_poly_reference"]
