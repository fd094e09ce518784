"""Exact quantile balancing: the Pallas kernels (pallas_kernels.quantile) against their XLA reference.

    python -m benchmarks.quantile --out BENCHMARKS.md     # GPU: checks, times, writes the section
    python -m benchmarks.quantile --sweep                 # GPU: also times other Blocks, prints them
    python -m benchmarks.quantile --smoke                 # CPU: tiny shapes in interpret mode, prints

quantile_bias (k=8, 4 sweeps, warm-started from the bias of another batch of the same skew) at the h200.py
step's shape per MoE layer, [32768 tokens, 64 experts], and at [65536, 256]; then one sweep
(margin_threshold) and each piece alone: choice_margins ([M, N] margins out) and exact_threshold (the
kernel path includes XLA's transpose of the margins into column-major order keys). Scores are sigmoids of
logits whose per-expert mean is skewed (popularity ~ N(0, 9)), as in tests/test_balance.py. Every result
must equal XLA's bit for bit; a mismatch makes the script exit non-zero.
"""

import sys

import jax
import numpy as np

from benchmarks.report import kernel_benchmark_args, provenance, publish
from benchmarks.timing import time_ms
from moejax.moe.balance import quantile_bias
from pallas_kernels.quantile import Blocks, choice_margins, exact_threshold, kernel, margin_threshold
from pallas_kernels.quantile import reference as ref

SECTION = "Quantile balance kernels"
K, ITERS = 8, 4
SHAPES = [(32768, 64), (65536, 256)]
SMOKE_SHAPES = [(300, 24)]
# --sweep: (radix bits, threshold rows, threshold warps, per_candidate) and (margin rows, margin warps).
THRESHOLD_SWEEP = [(2, 32768, 32, True), (2, 32768, 16, True), (2, 16384, 16, True), (2, 16384, 16, False),
                   (1, 32768, 16, True), (1, 32768, 16, False), (4, 32768, 32, True), (4, 8192, 16, False)]
MARGIN_SWEEP = [(16, 4), (32, 4)]


def scores_and_bias(m, n, seed=0):
  """Skewed sigmoid scores and the warm start: the XLA bias of another batch with the same skew."""
  k_pop, k_a, k_b = jax.random.split(jax.random.key(seed), 3)
  pop = 3.0 * jax.random.normal(k_pop, (n,))
  draw = lambda key: jax.nn.sigmoid(pop + jax.random.normal(key, (m, n)))
  prev = draw(k_b)
  return draw(k_a), jax.jit(lambda s: quantile_bias(s, K, None, ITERS, implementation="xla"))(prev)


def same_bits(a, b) -> bool:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def ops(m, n):
  """(name, function of (impl, s, b, c)), the balance first."""
  num_above = m * K / n
  return [
      (f"quantile_bias (k={K}, {ITERS} sweeps)",
       lambda impl, s, b, c: quantile_bias(s, K, b, ITERS, implementation=impl)),
      ("one sweep (margin_threshold)",
       lambda impl, s, b, c: margin_threshold(s, b, K, num_above, implementation=impl)),
      ("choice_margins", lambda impl, s, b, c: choice_margins(s, b, K, implementation=impl)),
      ("exact_threshold", lambda impl, s, b, c: exact_threshold(c, num_above, implementation=impl)),
  ]


def sweep(m, n, s, b, c, ours, log):
  """Each kernel alone under other Blocks; prints ms per launch, beside the floor of one jitted call."""
  interpret = ours == "interpret"
  tiny = jax.numpy.zeros(4)
  log(f"  floor: a jitted x + 1 on 4 floats, {time_ms(jax.jit(lambda x: x + 1), tiny):.4f} ms")
  keys = ref.ordered_key(c.T)
  q = ref.threshold_rank(m, m * K / n)
  want = jax.jit(lambda c: ref.exact_threshold(c, m * K / n))(c)
  threshold = lambda blocks: lambda keys: kernel.threshold_pallas(keys, q, blocks=blocks, interpret=interpret)
  margins = lambda blocks: lambda s, b: kernel.margins_pallas(
      s, b, K, blocks=blocks, write_margins=False, write_keys=True, interpret=interpret)[0]
  runs = [(f"threshold radix_bits={bits} rows={rows} warps={warps} per_candidate={per}", want, (keys,),
           threshold(Blocks(radix_bits=bits, threshold_rows=rows, threshold_warps=warps, per_candidate=per)))
          for bits, rows, warps, per in THRESHOLD_SWEEP]
  runs += [(f"margins (keys out) rows={rows} warps={warps}", keys, (s, b),
            margins(Blocks(margin_rows=rows, margin_warps=warps))) for rows, warps in MARGIN_SWEEP]
  for name, expected, operands, fn in runs:
    try:  # a candidate that fails to compile (registers, shared memory) is reported, not fatal
      f = jax.jit(fn)
      ok = same_bits(f(*operands), expected)
      log(f"  {name}: {time_ms(f, *operands):.4f} ms, equal {ok}")
    except Exception as e:  # noqa: BLE001
      log(f"  {name}: failed, {type(e).__name__}: {str(e)[:200]}")


def main():
  args = kernel_benchmark_args(__doc__.splitlines()[0], lambda p: p.add_argument(
      "--sweep", action="store_true", help="also time other Blocks for each kernel alone (printed only)"))
  ours = "interpret" if args.smoke else "pallas"
  log = lambda msg: print(msg, flush=True)
  rows, mismatches = [], []
  for m, n in SMOKE_SHAPES if args.smoke else SHAPES:
    s, b = scores_and_bias(m, n)
    c = jax.jit(lambda s, b: ref.choice_margins(s, b, K))(s, b)
    if args.sweep:
      log(f"sweep at [{m}, {n}] (ms per launch):")
      sweep(m, n, s, b, c, ours, log)
    for name, op in ops(m, n):
      got, times = {}, {}
      for impl in ("xla", ours):
        f = jax.jit(lambda s, b, c, impl=impl, op=op: op(impl, s, b, c))
        got[impl], times[impl] = f(s, b, c), time_ms(f, s, b, c)
      equal = same_bits(got[ours], got["xla"])
      if not equal:
        mismatches.append(f"[{m}, {n}] {name}")
      rows.append((f"[{m}, {n}]", name, times["xla"], times[ours], equal))
      log(f"[{m}, {n}] {name}: XLA {times['xla']:.4f} ms, {ours} {times[ours]:.4f} ms, bit-equal {equal}")
  d = Blocks()
  lines = [*provenance(jax.devices()[0].device_kind),
           f"Router scores [M tokens, N experts] float32, skewed; k={K}; the bias warm-started from another "
           f"batch's. Blocks: radix {d.radix_bits} bits, threshold blocks of {d.threshold_rows} keys with "
           f"{d.threshold_warps} warps{', per-candidate counts' if d.per_candidate else ''}, margins "
           f"{d.margin_warps} warps. exact_threshold's kernel path "
           "includes XLA's transpose of the margins into order keys. \"equal\": bit-for-bit.", "",
           f"| [M, N] | op | XLA ms | {ours} ms | XLA / {ours} | equal |", "|---|---|---|---|---|---|",
           *(f"| {shape} | {name} | {tx:.4f} | {tp:.4f} | {tx / tp:.2f}x | {eq} |"
             for shape, name, tx, tp, eq in rows)]
  publish(args.out, SECTION, lines)
  if mismatches:
    sys.exit(f"the kernels' results differ from XLA's: {', '.join(mismatches)}")


if __name__ == "__main__":
  main()
