"""SiLU of the causal depthwise short convolution within documents: reference and Pallas kernels."""

from pallas_kernels.short_conv.ops import IMPLEMENTATIONS, Blocks, conv_silu
from pallas_kernels.short_conv.reference import short_conv

__all__ = ["IMPLEMENTATIONS", "Blocks", "conv_silu", "short_conv"]
