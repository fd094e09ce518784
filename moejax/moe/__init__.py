"""Stable LatentMoE: the MoE layer, its router and token dispatch, expert parallelism, and the
routing balance (quantile, sign, aux-loss) with its metrics."""
