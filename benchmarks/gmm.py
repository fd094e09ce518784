"""Grouped matmul on one GPU: ours (Pallas/Triton) vs jax.lax.ragged_dot vs tokamax's ragged_dot.

    python -m benchmarks.gmm            # GPU: checks, tile sweep, timings; writes BENCHMARKS.md
    python -m benchmarks.gmm --smoke    # CPU: tiny shapes in interpret mode, prints only

Group sizes are Zipf-skewed (seeded; every 16th group empty) and sum to M. FLOPs: 2*M*K*N forward,
three times that for forward + both gradients. Each figure is the median over timed batches after a
warm-up, every batch ending in block_until_ready.

Every implementation's y, dlhs and drhs are compared with a float32 reference computed group by group
(one dense matmul per group at HIGHEST precision, from the host's group sizes), which shares no code
with any of the timed kernels and fits in memory at every shape (jax.lax.ragged_dot itself does not
at G=256). Our kernel failing the tolerance makes the script exit non-zero; a competitor's error is
reported, not fatal.
"""

import argparse
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import relative_error, replace_section
from benchmarks.timing import time_ms
from pallas_kernels.gmm import DEFAULT_TILING, Tile, Tiling, gmm
from pallas_kernels.gmm.kernel import gmm_pallas, tgmm_pallas

SHAPES = [(64, 65536, 2048, 1024), (256, 65536, 1024, 512)]          # G, M, K, N
SMOKE_SHAPES = [(4, 200, 64, 32), (8, 256, 32, 64)]
# Candidate tiles (bm, bk, bn, warps, stages); forward and dlhs share the list.
MM_TILES = [(128, 64, 128, 4, 4), (128, 64, 256, 8, 3), (64, 64, 128, 4, 4), (64, 64, 256, 4, 3),
            (128, 128, 128, 8, 3)]
T_TILES = [(64, 128, 128, 8, 3), (64, 128, 128, 4, 3), (128, 128, 128, 8, 3), (32, 128, 128, 4, 4),
           (64, 128, 256, 8, 3)]
SMOKE_TILES = [(16, 16, 16, 4, 2), (32, 16, 32, 4, 2)]
# More candidates for --sweep-only, which looks at the short contractions of the step's experts.
MM_TILES_WIDE = MM_TILES + [(128, 32, 256, 8, 4), (256, 64, 128, 8, 3), (128, 64, 256, 8, 4),
                            (128, 128, 256, 8, 2), (64, 64, 256, 4, 4), (128, 64, 128, 4, 3)]
T_TILES_WIDE = T_TILES + [(128, 64, 256, 8, 3), (64, 64, 256, 8, 4), (128, 128, 256, 8, 2)]
SECTION = "Grouped matmul"
TOL = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float32): 5e-3}  # vs the float32 reference


def zipf_group_sizes(g, m, seed=0, exponent=1.0):
  """Multinomial draw of m rows over g groups with Zipf weights on a seeded random rank order."""
  rng = np.random.default_rng(seed)
  p = 1.0 / np.arange(1, g + 1) ** exponent
  p = p[rng.permutation(g)]
  p[::16] = 0.0
  return rng.multinomial(m, p / p.sum()).astype(np.int32)


def bench(f, *args):
  """Median seconds per call (benchmarks.timing.time_ms)."""
  return time_ms(f, *args) * 1e-3


@jax.jit
def group_reference(x, w, sizes, dy):
  """(y, dlhs, drhs) in float32 at HIGHEST precision, one dense matmul per group over the rows masked
  to that group (G times the work, shapes fixed, so one compile); rows past sum(sizes) get 0."""
  mm = lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
  x, w, dy = (a.astype(jnp.float32) for a in (x, w, dy))
  ends = jnp.cumsum(sizes)
  rows = jnp.arange(x.shape[0])

  def group(g, carry):
    y, dx, dw = carry
    mine = ((rows >= ends[g] - sizes[g]) & (rows < ends[g]))[:, None]
    xg, dyg = jnp.where(mine, x, 0.0), jnp.where(mine, dy, 0.0)
    return y + mm(xg, w[g]), dx + mm(dyg, w[g].T), dw.at[g].set(mm(xg.T, dyg))

  init = (jnp.zeros((x.shape[0], w.shape[2])), jnp.zeros_like(x), jnp.zeros_like(w))
  return jax.lax.fori_loop(0, w.shape[0], group, init)


def errors(got, want):
  """Relative error of y, dlhs and drhs."""
  return [relative_error(a, b) for a, b in zip(got, want, strict=True)]


def fmt_err(errs):
  return " / ".join(f"{e:.1e}" for e in errs)


def fwd_fn(op):
  return jax.jit(lambda x, w, gs: op(x, w, gs))


def fwd_bwd_fn(op):
  def f(x, w, gs, dy):
    y, vjp = jax.vjp(lambda a, b: op(a, b, gs), x, w)
    return (y, *vjp(dy))
  return jax.jit(f)


def load_tokamax(smoke):
  """(label, op) for tokamax's ragged_dot, or (why not, None)."""
  try:
    import tokamax
  except Exception as e:  # noqa: BLE001 - any import failure means "not measured", with the reason
    return f"tokamax not importable ({type(e).__name__}: {e})", None
  impl = "xla" if smoke else "mosaic"
  label = f"tokamax {tokamax.__version__} ({'mosaic_gpu' if impl == 'mosaic' else 'xla, smoke only'})"
  return label, lambda x, w, gs: tokamax.ragged_dot(x, w, gs, implementation=impl)


def make_inputs(g, m, k, n, dtype, seed=0, sizes=None):
  key = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(key[0], (m, k), dtype)
  w = (jax.random.normal(key[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  dy = jax.random.normal(key[2], (m, n), dtype)
  gs = jnp.asarray(zipf_group_sizes(g, m, seed) if sizes is None else sizes, jnp.int32)
  return x, w, gs, dy


def check(op, args):
  """Relative errors of y, dlhs, drhs of op vs the float32 group reference."""
  x, w, gs, dy = args
  return errors(fwd_bwd_fn(op)(*args), group_reference(x, w, gs, dy))


def sweep(kernel_of_tile, tiles, args, log):
  """Time one kernel, kernel_of_tile(tile)(*args), over the candidate tiles; returns (best Tile, s)."""
  best = None
  for t in tiles:
    tile = Tile(*t)
    try:
      s = bench(jax.jit(kernel_of_tile(tile)), *args)
    except Exception as e:  # noqa: BLE001 - a tile that fails to compile is skipped, and said so
      log(f"    {t}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
      continue
    log(f"    {t}: {s * 1e3:.3f} ms")
    if best is None or s < best[1]:
      best = (tile, s)
  if best is None:
    raise RuntimeError("no candidate tile compiled")
  return best


def tune(args, tiles, t_tiles, interpret, log):
  """Best tile of each kernel alone. The arrays go in as arguments: closed over, jit would embed them."""
  dt = args[0].dtype
  log("  forward tiles:")
  fwd = sweep(lambda t: lambda x, w, gs, dy: gmm_pallas(x, w, gs, tile=t, out_dtype=dt, interpret=interpret),
              tiles, args, log)
  log("  dlhs tiles:")
  dlhs = sweep(lambda t: lambda x, w, gs, dy: gmm_pallas(dy, w, gs, tile=t, out_dtype=dt, transpose_rhs=True,
                                                         interpret=interpret), tiles, args, log)
  log("  drhs tiles:")
  drhs = sweep(lambda t: lambda x, w, gs, dy: tgmm_pallas(x, dy, gs, tile=t, out_dtype=dt,
                                                          interpret=interpret), t_tiles, args, log)
  return Tiling(fwd=fwd[0], dlhs=dlhs[0], drhs=drhs[0]), (fwd[1], dlhs[1], drhs[1])


def fmt_tile(t):
  return f"{t.bm}x{t.bk}x{t.bn} w{t.num_warps} s{t.num_stages}"


def run(args):
  lines, log = [], functools.partial(print, flush=True)
  smoke = args.smoke
  ours_impl = "interpret" if smoke else "pallas"
  dev = jax.devices()[0]
  if not smoke and dev.platform != "gpu":
    sys.exit(f"benchmarks/gmm.py needs a GPU (found {dev.platform}); use --smoke on CPU")
  tk_label, tk_op = load_tokamax(smoke)
  xla = lambda x, w, gs: gmm(x, w, gs, implementation="xla")
  ours = lambda tiling: (lambda x, w, gs: gmm(x, w, gs, tiling=tiling, implementation=ours_impl))
  failures = []

  # Odd shapes first: masked rows/columns/contraction, empty groups and a zero tail, bf16 and float32.
  log("== correctness on the device (ours vs the float32 group reference, rel err of y / dlhs / drhs)")
  lines += ["Checks on the device, ours vs the float32 group reference (relative error of y / dlhs / drhs):",
            "", "| case | rel err | ok |", "|---|---|---|"]
  odd = [("M=1000 K=320 N=200 G=7, sum<M, empty groups, bf16", (7, 1000, 320, 200), jnp.bfloat16,
          [0, 310, 5, 0, 400, 1, 200]),
         ("M=300 K=96 N=80 G=3, float32", (3, 300, 96, 80), jnp.float32, [100, 0, 150])]
  shapes = SMOKE_SHAPES if smoke else SHAPES
  for name, (g, m, k, n), dt, sizes in odd:
    errs = check(ours(None), make_inputs(g, m, k, n, dt, seed=1, sizes=sizes))
    ok = max(errs) < TOL[jnp.dtype(dt)]
    failures += [] if ok else [name]
    log(f"  {name}: {fmt_err(errs)} {'ok' if ok else 'FAIL'}")
    lines.append(f"| {name} | {fmt_err(errs)} | {'yes' if ok else '**NO**'} |")

  lines += ["", f"Timings; rel err = relative error of y / dlhs / drhs vs the float32 group reference on the "
            f"same inputs (bold past {TOL[jnp.dtype(jnp.bfloat16)]:.0e}).", "",
            "| G | M | K | N | implementation | fwd ms | fwd TFLOP/s | fwd+bwd ms "
            "| fwd+bwd TFLOP/s | rel err |", "|---|---|---|---|---|---|---|---|---|---|"]
  ratio_lines, tile_lines = [], []
  for g, m, k, n in shapes:
    x, w, gs, dy = make_inputs(g, m, k, n, jnp.bfloat16)
    sizes = np.asarray(gs)
    log(f"== G={g} M={m} K={k} N={n}: group sizes min {sizes.min()} median {int(np.median(sizes))} "
        f"max {sizes.max()}, {int((sizes == 0).sum())} empty")
    flops = 2.0 * m * k * n
    tiling, kernel_s = (DEFAULT_TILING, None)
    if not args.no_tune:
      tiling, kernel_s = tune((x, w, gs, dy), SMOKE_TILES if smoke else MM_TILES,
                              SMOKE_TILES if smoke else T_TILES, smoke, log)
      tile_lines.append(f"| {g} | {m} | {k} | {n} | " + " | ".join(
          f"{fmt_tile(t)} ({flops / s / 1e12:.0f})" for t, s in
          zip((tiling.fwd, tiling.dlhs, tiling.drhs), kernel_s, strict=True)) + " |")
    want = group_reference(x, w, gs, dy)
    impls = [("jax.lax.ragged_dot", xla)]
    impls += [("ours (tuned tiles)", ours(tiling))] if not args.no_tune else []
    impls += [("ours (default tiles)", ours(DEFAULT_TILING)), (tk_label, tk_op)]
    res = {}
    for name, op in impls:
      if op is None:
        lines.append(f"| {g} | {m} | {k} | {n} | {name} | - | - | - | - | - |")
        continue
      try:
        fb = fwd_bwd_fn(op)
        errs = errors(jax.block_until_ready(fb(x, w, gs, dy)), want)
        tf, tb = bench(fwd_fn(op), x, w, gs), bench(fb, x, w, gs, dy)
      except Exception as e:  # noqa: BLE001 - reported in the table instead of faked
        log(f"  {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        lines.append(f"| {g} | {m} | {k} | {n} | {name} | failed ({type(e).__name__}) | | | | |")
        continue
      above = not max(errs) < TOL[jnp.dtype(jnp.bfloat16)]
      failures += [f"{name} G={g}"] if above and name.startswith("ours") else []
      res[name] = (tf, tb)
      err_text = f"**{fmt_err(errs)}**" if above else fmt_err(errs)
      row = (f"{tf * 1e3:.3f} | {flops / tf / 1e12:.1f} | {tb * 1e3:.3f} | {3 * flops / tb / 1e12:.1f} | "
             f"{err_text}")
      log(f"  {name}: fwd {tf * 1e3:.3f} ms ({flops / tf / 1e12:.1f} TFLOP/s), fwd+bwd {tb * 1e3:.3f} ms "
          f"({3 * flops / tb / 1e12:.1f} TFLOP/s), rel err {fmt_err(errs)}{' ABOVE TOLERANCE' * above}")
      lines.append(f"| {g} | {m} | {k} | {n} | {name} | {row} |")
    del want
    for mine in [s for s in res if s.startswith("ours")]:
      for other in [s for s in res if not s.startswith("ours")]:
        r = [res[other][i] / res[mine][i] for i in range(2)]
        ratio_lines.append(f"| {g} | {mine} | {other} | {r[0]:.2f}x | {r[1]:.2f}x |")
        log(f"  {mine} vs {other}: fwd {r[0]:.2f}x, fwd+bwd {r[1]:.2f}x")

  lines += ["", "Speed-up (time of the other / ours):", "",
            "| G | ours | vs | fwd | fwd+bwd |", "|---|---|---|---|---|", *ratio_lines]
  if tile_lines:
    lines += ["", "Best tile per kernel in this run, bm x bk x bn, warps, stages (kernel alone, TFLOP/s):",
              "", "| G | M | K | N | forward | dlhs | drhs |", "|---|---|---|---|---|---|---|", *tile_lines]
  lines += fusion(shapes[0], ours(DEFAULT_TILING), log)
  return lines, failures


def fusion(shape, op, log):
  """SiTU-GLU gate/up as one grouped matmul on [G, K, 2N] weights vs two on [G, K, N]."""
  g, m, k, n = shape
  x, w, gs, dy = make_inputs(g, m, k, n, jnp.bfloat16)
  w2 = jnp.flip(w, axis=0)
  cat = jnp.concatenate([w, w2], axis=2)

  def two(x, w_cat, gs):
    return op(x, w_cat[..., :n], gs) + op(x, w_cat[..., n:], gs)

  def one(x, w_cat, gs):
    y = op(x, w_cat, gs)
    return y[:, :n] + y[:, n:]

  t_two, t_one = (bench(fwd_bwd_fn(f), x, cat, gs, dy) for f in (two, one))
  log(f"== gate/up fusion at G={g} M={m} K={k} N={n}: two gmm {t_two * 1e3:.3f} ms, one gmm on 2N "
      f"{t_one * 1e3:.3f} ms (fwd+bwd)")
  return ["", f"Gate/up fusion, fwd+bwd, G={g} M={m} K={k}, two N={n} grouped matmuls vs one on 2N={2 * n} "
          f"(default tiles): {t_two * 1e3:.3f} ms vs {t_one * 1e3:.3f} ms ({t_two / t_one:.2f}x)."]


def sweep_only(args):
  """--sweep-only: each kernel's tiles alone at the given shapes; prints, writes nothing."""
  log = functools.partial(print, flush=True)
  for text in args.shapes:
    g, m, k, n = (int(v) for v in text.split(","))
    args_ = make_inputs(g, m, k, n, jnp.bfloat16)
    log(f"== sweep G={g} M={m} K={k} N={n}")
    tiling, secs = tune(args_, SMOKE_TILES if args.smoke else MM_TILES_WIDE,
                        SMOKE_TILES if args.smoke else T_TILES_WIDE, args.smoke, log)
    flops = 2.0 * m * k * n
    for name, t, sec in zip(("forward", "dlhs", "drhs"), (tiling.fwd, tiling.dlhs, tiling.drhs), secs,
                            strict=True):
      log(f"  best {name}: {fmt_tile(t)}, {sec * 1e3:.3f} ms, {flops / sec / 1e12:.0f} TFLOP/s")


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--smoke", action="store_true", help="tiny shapes, Pallas interpret mode, CPU; no file")
  p.add_argument("--no-tune", action="store_true", help="skip the tile sweep; time the default tiles")
  p.add_argument("--out", default=None, help="markdown file to update (default BENCHMARKS.md on GPU)")
  p.add_argument("--sweep-only", action="store_true", help="only the tile sweep at --shapes; no file")
  p.add_argument("--shapes", nargs="+", default=["64,262144,512,768", "64,262144,768,512"],
                 metavar="G,M,K,N", help="with --sweep-only (default: the h200.py step's expert matmuls: "
                 "gate and up, then down)")
  args = p.parse_args()
  if args.smoke:
    jax.config.update("jax_platforms", "cpu")
  if args.sweep_only:
    sweep_only(args)
    return
  date = subprocess.run(["date", "-u"], capture_output=True, text=True).stdout.strip()
  lines, failures = run(args)
  dev = jax.devices()[0]
  header = [f"`{' '.join(['python3', *sys.argv])}` on {dev.device_kind} ({dev.platform}), "
            f"jax {jax.__version__}, {date}. bf16 inputs and outputs, float32 accumulation; group sizes "
            "Zipf-skewed (exponent 1, seeded, every 16th group empty), summing to M. FLOPs: 2MKN forward, "
            "3x for forward + both gradients.", ""]
  body = "\n".join(header + lines) + "\n"
  print("\n" + body)
  out = args.out or (None if args.smoke else os.path.join(os.path.dirname(__file__), "..", "BENCHMARKS.md"))
  if out:
    replace_section(out, SECTION, body)
    print(f"wrote the '{SECTION}' section of {os.path.abspath(out)}")
  if failures:
    sys.exit(f"correctness check failed: {failures}")


if __name__ == "__main__":
  main()
