"""Pallas (Triton lowering) kernels of the exact quantile balance. All GPU-launch code lives here.

margins:   c = s - where(v >= kth, next, kth),  v = s + b,  kth / next = the k-th and (k+1)-th largest
           of each row of v with multiplicity (what lax.top_k(v, k + 1) gives), as reference.choice_margins.
threshold: per column of the margins, the midpoint of the q-th and (q+1)-th largest (the q-th itself
           when tied), as reference.exact_threshold.

The margins kernel owns a block of rows with the whole expert row in registers (the experts padded to a
power of two, as Triton's block shapes must be). It finds kth and next without sorting: k + 1 rounds of
(row max of the entries left, how many equal it, remove them), tracking the cumulative count, so ties
count with their multiplicity. The max runs over int32 keys whose signed order is the total order
lax.top_k sorts by (-0 below +0, NaN above +inf, -NaN below -inf), so even those come out as XLA's.
It can write the margins [M, N] and/or their uint32 order keys transposed, [N, M], for the threshold
kernel, which then reads each column contiguously.

The threshold kernel owns one column: the radix selection of reference.kth_largest_key (32 / radix_bits
passes, each counting, for each of the 2^radix_bits candidates that extend the prefix found so far, the
keys at or above it), then one more pass for the ties count and the largest key below, all in one
launch where XLA runs two small kernels per pass. A column of up to Blocks.threshold_rows keys is
loaded once and every pass runs on registers; a longer one is read block by block in every pass. Rows
past M are loaded as key 0: they are never at or above a nonzero candidate, and candidate 0 (the
prefix) has q or more keys anyway; the ties count only sees them when the q-th key is 0 itself, which
has all m > q real keys at or above it, so ties holds either way.

Blocks' defaults come from short sweeps on the H200, not a tuned search; benchmarks/quantile.py --sweep
times alternatives.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.triton_masks import load, mask_and, next_pow2, store

_INT_MIN = -(1 << 31)


def _pow2(v) -> bool:
  return not isinstance(v, bool) and isinstance(v, int) and v >= 1 and not v & (v - 1)


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Block sizes and launch settings of the two kernels.

  margin_rows: tokens per margins program (a power of two); 0 picks max(1, min(32, 4096 // padded N)).
  radix_bits: digit width of the threshold's radix selection, dividing 32: 32 / radix_bits passes over
    each column, each comparing every key with the 2^radix_bits candidates.
  threshold_rows: keys per block of a threshold program's column (a power of two), cut to
    2^17 / 2^radix_bits. A column of at most this many rows is loaded once and kept in registers for
    all passes; a longer one is read from L2 once per pass, block by block.
  per_candidate: count each candidate's keys with a reduction of its own (2^radix_bits - 1 of them per
    block; radix_bits <= 4), instead of summing a [rows, 2^radix_bits] tile of comparisons at once, a
    tile that spills registers when large.
  num_stages: Triton's software pipelining of the block loops.
  The defaults are the best of short sweeps on the H200 (benchmarks/quantile.py --sweep), not of a
  tuned search. The threshold kernel alone, per launch (a jitted no-op took 0.03-0.05 ms there, so the
  small figures are at that floor): at [65536, 256] these defaults took 0.196 ms, 16 warps 0.273,
  1-bit digits 0.504, 4-bit 0.450; summed tiles of 16384 rows 0.368. At [32768, 64]: 0.046 ms, with
  16 warps 0.040, 1-bit 0.033; summed tiles 0.087, and tiles of [32768 rows, 4 candidates] with 8 or
  16 warps spilled registers (0.6-1.4 ms). A first form streaming 1024-key blocks with 8 warps took
  0.17 ms, bound by the latency of its 17 x 32 dependent loads.
  """
  margin_rows: int = 0
  margin_warps: int = 4
  radix_bits: int = 2
  threshold_rows: int = 32768
  threshold_warps: int = 32
  per_candidate: bool = True
  num_stages: int = 1

  def __post_init__(self):
    if not (self.margin_rows == 0 or _pow2(self.margin_rows)):
      raise ValueError(f"Blocks.margin_rows must be 0 (auto) or a power of two, got {self.margin_rows!r}")
    if self.radix_bits not in (1, 2, 4, 8):
      raise ValueError(f"Blocks.radix_bits must divide 32 (1, 2, 4 or 8), got {self.radix_bits!r}")
    if not isinstance(self.per_candidate, bool):
      raise ValueError(f"Blocks.per_candidate must be a bool, got {self.per_candidate!r}")
    if self.per_candidate and self.radix_bits > 4:
      raise ValueError(f"Blocks.per_candidate=True takes radix_bits <= 4 ({2**self.radix_bits - 1} "
                       f"reductions per block and pass otherwise); pass per_candidate=False for "
                       f"radix_bits={self.radix_bits}")
    for name in ("threshold_rows", "margin_warps", "threshold_warps", "num_stages"):
      if not _pow2(getattr(self, name)):
        raise ValueError(f"Blocks.{name} must be a power of two, got {getattr(self, name)!r}")

  def rows_for(self, n_pad: int) -> int:
    return self.margin_rows or max(1, min(32, 4096 // n_pad))


def _params(warps: int, stages: int):
  return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def _signed_key(x):
  """int32 keys of float32 x in lax.top_k's total order; the map is its own inverse on the bits."""
  bits = lax.bitcast_convert_type(x, jnp.int32)
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _signed_key_value(key):
  return lax.bitcast_convert_type(key ^ ((key >> 31) & 0x7FFFFFFF), jnp.float32)


def _margins_kernel(s_ref, b_ref, *out_refs, k, m, n, bm, n_pad, write_margins, write_keys):
  row0 = pl.program_id(0) * bm
  # Static checks keep the masks out of the evenly divisible case.
  row_in = (row0 + jnp.arange(bm) < m) if m % bm else None
  col_in = (jnp.arange(n_pad) < n) if n < n_pad else None
  mask = mask_and(None if row_in is None else row_in[:, None], None if col_in is None else col_in[None, :])
  s = load(s_ref.at[pl.ds(row0, bm), pl.ds(0, n_pad)], mask, 0.0)
  v = s + load(b_ref.at[pl.ds(0, n_pad)], col_in, 0.0)[None, :]
  key = _signed_key(v)
  if col_in is not None:  # padded experts sit below every real one (an equal -NaN still counts right)
    key = jnp.where(col_in[None, :], key, _INT_MIN)

  def round_(_, carry):
    rest, cum, kth, nxt = carry
    top = jnp.max(rest, axis=1)
    eq = rest == top[:, None]
    now = cum + jnp.sum(eq.astype(jnp.int32), axis=1)
    # If only INT_MIN keys are left (a row of -NaN), `eq` counts removed ones too; everything left is
    # then that value, so kth and next come out right all the same.
    kth = jnp.where((cum < k) & (now >= k), top, kth)
    nxt = jnp.where((cum <= k) & (now > k), top, nxt)
    return jnp.where(eq, _INT_MIN, rest), now, kth, nxt

  init = jnp.full((bm,), _INT_MIN, jnp.int32)
  _, _, kth, nxt = lax.fori_loop(0, k + 1, round_, (key, jnp.zeros((bm,), jnp.int32), init, init))
  kth_v, nxt_v = _signed_key_value(kth)[:, None], _signed_key_value(nxt)[:, None]
  c = s - jnp.where(v >= kth_v, nxt_v, kth_v)
  refs = list(out_refs)
  if write_margins:
    store(refs.pop(0).at[pl.ds(row0, bm), pl.ds(0, n_pad)], c, mask)
  if write_keys:
    # reference.ordered_key: the signed key with its top bit flipped, unsigned.
    ukey = lax.bitcast_convert_type(_signed_key(c) ^ _INT_MIN, jnp.uint32)
    mask_t = mask_and(None if col_in is None else col_in[:, None],
                      None if row_in is None else row_in[None, :])
    store(refs.pop(0).at[pl.ds(0, n_pad), pl.ds(row0, bm)], ukey.T, mask_t)


def margins_pallas(scores_MN, bias_N, k: int, *, blocks: Blocks, write_margins: bool = True,
                   write_keys: bool = False, interpret: bool = False):
  """(c [M, N] float32 if write_margins, ordered keys of c [N, M] uint32 if write_keys), as a tuple.
  Inputs are float32 and validated by ops."""
  m, n = scores_MN.shape
  n_pad = next_pow2(n)
  bm = blocks.rows_for(n_pad)
  out_shape = ([jax.ShapeDtypeStruct((m, n), jnp.float32)] * write_margins
               + [jax.ShapeDtypeStruct((n, m), jnp.uint32)] * write_keys)
  kernel = functools.partial(_margins_kernel, k=k, m=m, n=n, bm=bm, n_pad=n_pad,
                             write_margins=write_margins, write_keys=write_keys)
  return pl.pallas_call(
      kernel, out_shape=tuple(out_shape), grid=(pl.cdiv(m, bm),),
      compiler_params=_params(blocks.margin_warps, blocks.num_stages), interpret=interpret,
      name="quantile_margins")(scores_MN, bias_N)


def _threshold_kernel(key_ref, t_ref, *, m, q, bits, bm, per_candidate):
  j = pl.program_id(0)
  blocks = pl.cdiv(m, bm)

  def keys(i):
    mask = (i * bm + jnp.arange(bm) < m) if m % bm else None
    return load(key_ref.at[j, pl.ds(i * bm, bm)], mask, 0)

  # A column that fits one block is loaded once and stays in registers for every pass; a longer one
  # is streamed from L2 once per pass.
  resident = keys(0) if blocks == 1 else None

  def over_column(fn, init):
    """fn(keys of a block, carry) folded over the column's blocks."""
    if resident is not None:
      return fn(resident, init)
    return lax.fori_loop(0, blocks, lambda i, carry: fn(keys(i), carry), init)

  prefix = jnp.uint32(0)
  for shift in range(32 - bits, -1, -bits):
    # Counts fall as the candidate grows, and candidate 0 (the prefix) always has q or more: the digit
    # is the number of other candidates with q or more.
    if per_candidate:
      cands = [prefix | jnp.uint32(d << shift) for d in range(1, 1 << bits)]
      counts = over_column(
          lambda key, acc, cands=cands: tuple(a + jnp.sum((key >= c).astype(jnp.int32))
                                              for a, c in zip(acc, cands, strict=True)),
          (jnp.int32(0),) * len(cands))
      digit = sum((c >= q).astype(jnp.int32) for c in counts)
    else:
      cand = prefix | (jnp.arange(1 << bits, dtype=jnp.int32).astype(jnp.uint32) << shift)
      tile = lambda key, cand=cand: (key[:, None] >= cand[None, :]).astype(jnp.int32)
      count = over_column(lambda key, acc, tile=tile: acc + jnp.sum(tile(key), axis=0),
                          jnp.zeros((1 << bits,), jnp.int32))
      digit = jnp.sum((count >= q).astype(jnp.int32)) - 1
    prefix = prefix | (digit.astype(jnp.uint32) << shift)

  def ties_and_below(key, carry):
    at_or_above, below = carry
    return (at_or_above + jnp.sum((key >= prefix).astype(jnp.int32)),
            jnp.maximum(below, jnp.max(jnp.where(key < prefix, key, jnp.uint32(0)))))

  at_or_above, below = over_column(ties_and_below, (jnp.int32(0), jnp.uint32(0)))
  kth_v = _unsigned_key_value(prefix)
  # Key 0 when nothing is below: then all m keys tie at or above the q-th and `below` is unused.
  t_ref[j] = 0.5 * (kth_v + jnp.where(at_or_above > q, kth_v, _unsigned_key_value(below)))


def _unsigned_key_value(key):
  """reference.key_value, through the signed key (the top bit flipped)."""
  return _signed_key_value(lax.bitcast_convert_type(key, jnp.int32) ^ _INT_MIN)


def threshold_pallas(keys_NM, q: int, *, blocks: Blocks, interpret: bool = False):
  """t [N] float32: per row of the ordered keys [N, M] (columns of the margins), the midpoint of the
  q-th and (q+1)-th largest values, 1 <= q <= M - 1."""
  n, m = keys_NM.shape
  bm = min(blocks.threshold_rows, next_pow2(m), (1 << 17) >> blocks.radix_bits)
  kernel = functools.partial(_threshold_kernel, m=m, q=q, bits=blocks.radix_bits, bm=bm,
                             per_candidate=blocks.per_candidate)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=(n,),
      compiler_params=_params(blocks.threshold_warps, blocks.num_stages), interpret=interpret,
      name="quantile_threshold")(keys_NM)
