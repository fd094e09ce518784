"""The KDA layer's short convolution + SiLU (+ the l2 norm of q and k): Pallas kernels vs XLA.

    python -m benchmarks.short_conv --out BENCHMARKS.md     # GPU: checks, times, writes the section
    python -m benchmarks.short_conv --sweep 32,4 64,8 ...   # GPU: also times these row blocks, warps
    python -m benchmarks.short_conv --smoke                 # CPU: tiny shapes in interpret mode, prints

At the h200.py step's shape per branch (B=4 T=8192, 8 heads of 128 channels, W=4, bf16 in and out,
packed documents of geometric length, mean 2048), in the layer's two forms: q and k (each head
l2-normalised) and v (not). XLA's is the "xla" path (the reference's forward, a barrier, the norm; the
hand-written backward pass), as the layer ran it before the kernels. Both run forward and forward +
backward (dx, dw). Bytes: x read and y written once forward; x and dy read, dx written backward.
Relative errors against the "xla" path on float32 copies of the same inputs.
"""


import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import fwd_bwd_table, kernel_benchmark_args, provenance, publish, relative_error
from benchmarks.timing import copy_floor_note, time_ms
from pallas_kernels.kda.lowering import Tuning
from pallas_kernels.short_conv import Blocks, conv_silu

SECTION = "Short convolution"
EPS = 1e-6  # config.model.norm_eps


def fwd_bwd(impl, eps, out_dtype, blocks=None):
  def f(x, w, doc, dy):
    y, vjp = jax.vjp(lambda x, w: conv_silu(x, w, doc, implementation=impl, out_dtype=out_dtype,
                                            normalize_eps=eps, blocks=blocks), x, w)
    return (y, *vjp(dy))
  return jax.jit(f)


def fwd(impl, eps, out_dtype, blocks=None):
  return jax.jit(lambda x, w, doc: conv_silu(x, w, doc, implementation=impl, out_dtype=out_dtype,
                                             normalize_eps=eps, blocks=blocks))


def sweep_blocks(text: str) -> Blocks:
  """ROWS,WARPS[,DZ_ROW_BLOCKS] (the last at its default when left out)."""
  rows, warps, *rest = (int(v) for v in text.split(","))
  tuning = Tuning(num_warps=warps, num_stages=1)
  more = {"dz_row_blocks": rest[0]} if rest else {}
  return Blocks(rows=rows, fwd=tuning, dz=tuning, dx=tuning, **more)


def main():
  args = kernel_benchmark_args(__doc__.splitlines()[0], lambda p: p.add_argument(
      "--sweep", nargs="*", default=[], metavar="ROWS,WARPS[,DZ_ROW_BLOCKS]",
      help="also time the kernels at these row blocks and warps (all three kernels alike)"))
  B, T, H, K = (1, 100, 2, 16) if args.smoke else (4, 8192, 8, 128)
  ours = "interpret" if args.smoke else "pallas"
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((4, H, K)) * 0.5, jnp.float32)
  dy = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.bfloat16)
  doc = jnp.asarray(np.cumsum(rng.random((B, T)) < 1 / 2048, axis=1), jnp.int32)

  rows, times = [], {}
  for form, eps in (("q, k (normalised)", EPS), ("v", None)):
    want = fwd_bwd("xla", eps, jnp.float32)(x.astype(jnp.float32), w, doc, dy.astype(jnp.float32))
    for name, impl in ((f"ours ({ours})", ours), ("XLA", "xla")):
      got = fwd_bwd(impl, eps, jnp.bfloat16)(x, w, doc, dy)
      errs = " / ".join(f"{relative_error(a, b):.1e}" for a, b in zip(got, want, strict=True))
      tf = time_ms(fwd(impl, eps, jnp.bfloat16), x, w, doc)
      tb = time_ms(fwd_bwd(impl, eps, jnp.bfloat16), x, w, doc, dy)
      times[form, impl] = (tf, tb)
      rows.append((f"{form}: {name}", tf, tb, errs))
      print(f"{form}, {name}: fwd {tf:.3f} ms, fwd+bwd {tb:.3f} ms, rel err y / dx / dw {errs}", flush=True)
  sweep = []
  for text in args.sweep:
    blocks = sweep_blocks(text)
    for form, eps in (("q, k", EPS), ("v", None)):
      tf = time_ms(fwd(ours, eps, jnp.bfloat16, blocks), x, w, doc)
      tb = time_ms(fwd_bwd(ours, eps, jnp.bfloat16, blocks), x, w, doc, dy)
      sweep.append(f"| {form} | {blocks.rows} | {blocks.fwd.num_warps} | {blocks.dz_row_blocks} | {tf:.3f} | "
                   f"{tb:.3f} |")
      print(f"sweep {form} rows {blocks.rows} warps {blocks.fwd.num_warps} dz row blocks "
            f"{blocks.dz_row_blocks}: fwd {tf:.3f} ms, fwd+bwd {tb:.3f} ms", flush=True)
  n = B * T * H * K
  bytes_fwd, bytes_bwd = n * (2 + 2), n * (2 + 2 + 2)
  floor = "" if args.smoke else copy_floor_note(bytes_fwd, bytes_fwd + bytes_bwd)
  d = Blocks()
  lines = [*provenance(jax.devices()[0].device_kind),
           f"B={B} T={T} H={H} K={K} (one of the KDA layer's q/k/v branches in `experiments/h200.py`), "
           f"W=4, bf16 in and out, packed documents (mean length 2048); ours at the default blocks "
           f"({d.rows} rows, {d.cols} columns or one head, {d.dz_row_blocks} row blocks per dz program, "
           f"{d.fwd.num_warps}/{d.dz.num_warps}/{d.dx.num_warps} warps).{floor}", "",
           *fwd_bwd_table(rows, "rel err y / dx / dw vs float32 XLA")]
  for form in ("q, k (normalised)", "v"):
    r = [times[form, "xla"][i] / times[form, ours][i] for i in range(2)]
    lines += ["", f"{form}: XLA time / ours: forward {r[0]:.2f}x, forward + backward {r[1]:.2f}x."]
  if sweep:
    lines += ["", "Row blocks and warps (all three kernels alike):", "",
              "| form | rows | warps | dz row blocks | fwd ms | fwd+bwd ms |", "|---|---|---|---|---|---|",
              *sweep]
  publish(args.out, SECTION, lines)


if __name__ == "__main__":
  main()
