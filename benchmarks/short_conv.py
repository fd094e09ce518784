"""The KDA layer's short convolution + SiLU: Pallas kernels vs the XLA reference with autodiff.

    python3 benchmarks/short_conv.py --out BENCHMARKS.md     # GPU: checks, times, writes the section
    python3 benchmarks/short_conv.py --smoke                 # CPU: tiny shapes in interpret mode, prints

At the h200.py step's shape per branch (B=4 T=8192, 8 heads of 128 channels, W=4, bf16, packed documents
of geometric length, mean 2048). Both run forward (x -> silu(conv), float32 out, as the layer takes it)
and forward + backward (dx, dw). Bytes: x read and y written once forward; x and dy read, dx written
backward. Relative errors against the XLA path on float32 copies of the same inputs.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import fwd_bwd_table, kernel_benchmark_args, provenance, publish, relative_error  # noqa: E402
from benchmarks.timing import copy_floor_note, time_ms  # noqa: E402
from pallas_kernels.short_conv import conv_silu  # noqa: E402

SECTION = "Short convolution"


def fwd_bwd(impl):
  def f(x, w, doc, dy):
    y, vjp = jax.vjp(lambda x, w: conv_silu(x, w, doc, implementation=impl, out_dtype=jnp.float32), x, w)
    return (y, *vjp(dy))
  return jax.jit(f)


def fwd(impl):
  return jax.jit(lambda x, w, doc: conv_silu(x, w, doc, implementation=impl, out_dtype=jnp.float32))


def main():
  args = kernel_benchmark_args(__doc__.splitlines()[0])
  B, T, H, K = (1, 100, 2, 16) if args.smoke else (4, 8192, 8, 128)
  ours = "interpret" if args.smoke else "pallas"
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((4, H, K)) * 0.5, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32)
  doc = jnp.asarray(np.cumsum(rng.random((B, T)) < 1 / 2048, axis=1), jnp.int32)

  want = fwd_bwd("xla")(x.astype(jnp.float32), w, doc, dy)
  rows, times = [], {}
  for name, impl in ((f"ours ({ours})", ours), ("XLA reference + autodiff", "xla")):
    got = fwd_bwd(impl)(x, w, doc, dy)
    errs = " / ".join(f"{relative_error(a, b):.1e}" for a, b in zip(got, want, strict=True))
    tf, tb = time_ms(fwd(impl), x, w, doc), time_ms(fwd_bwd(impl), x, w, doc, dy)
    times[impl] = (tf, tb)
    rows.append((name, tf, tb, errs))
    print(f"{name}: fwd {tf:.3f} ms, fwd+bwd {tb:.3f} ms, rel err y / dx / dw {errs}", flush=True)
  n = B * T * H * K
  bytes_fwd, bytes_bwd = n * (2 + 4), n * (2 + 4 + 2)
  floor = "" if args.smoke else copy_floor_note(bytes_fwd, bytes_fwd + bytes_bwd)
  lines = [*provenance(jax.devices()[0].device_kind),
           f"B={B} T={T} H={H} K={K} (one of the KDA layer's q/k/v branches in `experiments/h200.py`), "
           f"W=4, bf16 in, float32 out, packed documents (mean length 2048).{floor}", "",
           *fwd_bwd_table(rows, "rel err y / dx / dw vs float32 XLA")]
  r = [times["xla"][i] / times[ours][i] for i in range(2)]
  lines += ["", f"XLA time / ours: forward {r[0]:.2f}x, forward + backward {r[1]:.2f}x."]
  publish(args.out, SECTION, lines)


if __name__ == "__main__":
  main()
