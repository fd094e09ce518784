"""What the Pallas KDA kernels take: chunk sizes and head widths, the one rule that both the op and
config validation (moejax.config) apply.
"""

CHUNK_SIZES = (16, 32, 64, 128)
MAX_WIDTH = 256
# At chunk 128, wider heads' tiles overflow the H200's shared memory even unpipelined (the kernels asked
# for 264 KiB; the card has 227 KiB per block).
MAX_WIDTH_AT_128 = 128


def padded_width(n: int) -> int:
  """The tile width a head dim of n runs at: the next power of two, at least 16."""
  return max(16, 1 << (n - 1).bit_length())


def unsupported(chunk_size: int, K: int, V: int) -> str | None:
  """Why the Pallas KDA kernels cannot run chunk_size with head dims K and V; None when they can."""
  if chunk_size not in CHUNK_SIZES:
    return f"the Pallas KDA kernel needs chunk_size in {CHUNK_SIZES}, got {chunk_size}"
  if K > MAX_WIDTH or V > MAX_WIDTH:
    return f"the Pallas KDA kernel supports K and V up to {MAX_WIDTH}, got K={K} V={V}"
  if chunk_size == 128 and max(padded_width(K), padded_width(V)) > MAX_WIDTH_AT_128:
    return (f"the Pallas KDA kernel at chunk_size 128 supports K and V up to {MAX_WIDTH_AT_128} (wider "
            f"tiles overflow the GPU's shared memory), got K={K} V={V}; use chunk_size 64 or less")
  return None
