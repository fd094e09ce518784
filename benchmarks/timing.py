"""Timing and ceilings shared by the GPU benchmarks. Imports jax on first use only, so that a
benchmark's child process for a PyTorch competitor can import its module without claiming the GPU."""

import statistics
import time


def time_ms(fn, *args, calls=None, repeats=None, group_s=0.1, total_s=1.0) -> float:
  """Median over `repeats` of the mean time of `calls` back-to-back calls (one sync per group); by
  default about group_s per group and total_s in all, at least 3 groups. The first call (compilation)
  is not timed.

  A group's first call is dispatched with the device idle, so each group adds one dispatch to the
  device's time; groups of many calls make that a small part: with short groups a long call runs in
  groups of two, and its time then sits well above its kernels' sum in a profile (BENCHMARKS.md,
  "KDA kernel", its conventions)."""
  import jax

  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  once = time.perf_counter() - t0
  calls = calls or max(1, min(200, int(group_s / max(once, 1e-9))))
  repeats = repeats or max(3, min(15, int(total_s / max(once * calls, 1e-9))))
  samples = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / calls * 1e3)
  return statistics.median(samples)


from moejax.flops import SPEC_BF16_PEAK, spec_bf16_peak  # noqa: E402,F401 - the benchmarks' imports


def matmul_rate(n: int = 8192) -> float:
  """Measured bf16 n^3 matmul rate of this device, FLOP/s (XLA's own dot)."""
  import jax
  import jax.numpy as jnp

  a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  mm = jax.jit(lambda a: a @ a)
  return 2 * n**3 / (time_ms(mm, a, calls=5, repeats=7) * 1e-3)


def copy_bandwidth(gib: int = 2) -> float:
  """Measured bytes read + written per second by an elementwise pass over `gib` GiB of float32."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones((gib * 256, 1024, 1024), jnp.float32)
  copy = jax.jit(lambda x: x + 1.0)
  return 2 * x.nbytes / (time_ms(copy, x, calls=5, repeats=7) * 1e-3)


def copy_floor_note(fwd_bytes: int, fwd_bwd_bytes: int) -> str:
  """' Floor at the measured copy rate (...): forward X ms, forward + backward Y ms.', for a table's
  caption: the time that moving those bytes once takes at copy_bandwidth()."""
  bw = copy_bandwidth()
  return (f" Floor at the measured copy rate ({bw / 1e12:.2f} TB/s): forward {fwd_bytes / bw * 1e3:.3f} ms, "
          f"forward + backward {fwd_bwd_bytes / bw * 1e3:.3f} ms.")
