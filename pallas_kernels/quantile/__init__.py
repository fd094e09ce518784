"""Exact quantile balancing's per-sweep work (docs/design.md §5): Pallas GPU kernels beside the XLA
reference."""

from pallas_kernels.quantile.kernel import Blocks
from pallas_kernels.quantile.ops import (
    IMPLEMENTATIONS,
    choice_margins,
    exact_threshold,
    margin_threshold,
    resolve_implementation,
)

__all__ = ["IMPLEMENTATIONS", "Blocks", "choice_margins", "exact_threshold", "margin_threshold",
           "resolve_implementation"]
