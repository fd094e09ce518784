"""Pallas GPU kernels for moejax, each beside the pure-JAX reference it must match."""
