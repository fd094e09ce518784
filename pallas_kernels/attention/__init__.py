"""Attention within packed documents, causal or bidirectional, that visits only the tiles a document
can reach."""

from pallas_kernels.attention.ops import IMPLEMENTATIONS, Blocks, document_attention
from pallas_kernels.attention.reference import document_attention_reference

__all__ = ["IMPLEMENTATIONS", "Blocks", "document_attention", "document_attention_reference"]
