"""The routed experts' SiTU-GLU MLP on one GPU: fused into the grouped matmuls vs not.

    python3 benchmarks/grouped_glu.py            # GPU: checks, timings (and --sweep); writes BENCHMARKS.md
    python3 benchmarks/grouped_glu.py --smoke    # CPU: tiny shapes in interpret mode, prints only

"fused" is pallas_kernels.gmm.situ_glu (what the MoE layer runs on GPU): gate and up in one kernel with
SiTU-GLU in its epilogue, dh with the SiTU-GLU gradient in its epilogue, dx as one kernel. "unfused" is
the same Pallas grouped matmuls called one by one with XLA's element-wise SiTU-GLU pass between them in
each direction (moejax.layers.ffn.situ_glu): the step's path before the fusion. Both run in this call
on the same inputs; FLOPs are 3 x 2RLF forward and three times that for forward + backward. Each is
checked against a float32 run of the unfused path (Pallas grouped matmuls at float32 precision and the
float32 element-wise math), relative errors of y, dx and the three weight gradients.
"""

import argparse
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gmm import bench, zipf_group_sizes  # noqa: E402
from benchmarks.report import replace_section  # noqa: E402
from moejax.layers.ffn import situ_glu  # noqa: E402
from pallas_kernels.gmm import Tile, gmm  # noqa: E402
from pallas_kernels.gmm.situ_glu import GLUTiling, grouped_situ_glu_fused  # noqa: E402

B1, B2 = 4.0, 25.0
# G, R (rows = tokens x top-k), L (latent), F (expert hidden). The first is experiments/h200.py's step.
SHAPES = [(64, 262144, 512, 768), (64, 65536, 2048, 1024)]
SMOKE_SHAPES = [(4, 200, 64, 48)]
SECTION = "Grouped SiTU-GLU"
TOL = 2e-2
# --sweep: each fused kernel's tile varied alone around the default (bm, bk, bn, warps, stages).
SWEEP = {"gate_up": [(128, 64, 128, 4, 3), (64, 64, 128, 4, 4), (128, 32, 128, 8, 4), (128, 64, 64, 4, 4)],
         "dh": [(128, 64, 128, 4, 3), (128, 64, 256, 8, 3), (64, 64, 128, 4, 4)],
         "dx": [(128, 64, 128, 8, 2), (128, 32, 128, 8, 3), (64, 64, 128, 4, 3)]}


def unfused(interpret):
  impl = "interpret" if interpret else "pallas"

  def f(x, sizes, w_gate, w_up, w_down):
    rdot = lambda a, w: gmm(a, w, sizes, preferred_element_type=x.dtype, implementation=impl)
    return rdot(situ_glu(rdot(x, w_gate), rdot(x, w_up), B1, B2), w_down)
  return f


def fused(interpret, tiling=None):
  return lambda x, sizes, *w: grouped_situ_glu_fused(x, sizes, *w, B1, B2, tiling=tiling, interpret=interpret)


def fwd_fn(op):
  return jax.jit(op)


def fwd_bwd_fn(op):
  def f(x, sizes, ws, dy):
    y, vjp = jax.vjp(lambda x, *w: op(x, sizes, *w), x, *ws)
    return (y, *vjp(dy))
  return jax.jit(f)


def make_inputs(g, r, l_in, f, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(keys[0], (r, l_in), jnp.float32)
  ws = tuple((jax.random.normal(k, s, jnp.float32) / np.sqrt(s[1])).astype(dtype)
             for k, s in zip(keys[1:4], [(g, l_in, f), (g, l_in, f), (g, f, l_in)], strict=True))
  dy = jax.random.normal(keys[4], (r, l_in), dtype)
  return x.astype(dtype), jnp.asarray(zipf_group_sizes(g, r, seed), jnp.int32), ws, dy


def rel_errs(got, want):
  return [float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
          for a, b in zip(got, want, strict=True)]


def run(args):
  log = functools.partial(print, flush=True)
  interpret = args.smoke
  if not interpret and jax.devices()[0].platform != "gpu":
    sys.exit("benchmarks/grouped_glu.py needs a GPU; use --smoke on CPU")
  lines = ["| G | R | L | F | path | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | rel err y / dx / "
           "dWg / dWu / dWd |", "|---|---|---|---|---|---|---|---|---|---|"]
  ratios, sweep_lines, failures = [], [], []
  for g, r, l_in, f in SMOKE_SHAPES if args.smoke else SHAPES:
    x, sizes, ws, dy = make_inputs(g, r, l_in, f, jnp.bfloat16)
    f32 = lambda t: t.astype(jnp.float32)
    want = fwd_bwd_fn(unfused(interpret))(f32(x), sizes, tuple(map(f32, ws)), f32(dy))
    flops = 3 * 2.0 * r * l_in * f
    log(f"== G={g} R={r} L={l_in} F={f}: group sizes max {int(sizes.max())}, {int((sizes == 0).sum())} empty")
    times = {}
    for name, op in (("unfused", unfused(interpret)), ("fused (ours)", fused(interpret))):
      fb = fwd_bwd_fn(op)
      errs = rel_errs(jax.block_until_ready(fb(x, sizes, ws, dy)), want)
      tf, tb = bench(fwd_fn(op), x, sizes, *ws), bench(fb, x, sizes, ws, dy)
      times[name] = (tf, tb)
      bad = max(errs) >= TOL
      failures += [f"{name} G={g}"] if bad else []
      err_text = " / ".join(f"{e:.1e}" for e in errs)
      log(f"  {name}: fwd {tf * 1e3:.3f} ms, fwd+bwd {tb * 1e3:.3f} ms, rel err {err_text}"
          + " ABOVE TOLERANCE" * bad)
      lines.append(f"| {g} | {r} | {l_in} | {f} | {name} | {tf * 1e3:.3f} | {flops / tf / 1e12:.1f} | "
                   f"{tb * 1e3:.3f} | {3 * flops / tb / 1e12:.1f} | {'**' * bad}{err_text}{'**' * bad} |")
    rf, rb = (times["unfused"][i] / times["fused (ours)"][i] for i in range(2))
    ratios.append(f"| {g} | {r} | {l_in} | {f} | {rf:.2f}x | {rb:.2f}x |")
    log(f"  fused speed-up: fwd {rf:.2f}x, fwd+bwd {rb:.2f}x")
    if args.sweep:
      base = GLUTiling()
      for kernel, tiles in SWEEP.items():
        for t in tiles:
          tiling = GLUTiling(**{**{k: getattr(base, k) for k in ("gate_up", "dh", "dx", "plain")},
                                kernel: Tile(*t)})
          op = fused(interpret, tiling)
          tb = bench(fwd_bwd_fn(op), x, sizes, ws, dy)
          tf = bench(fwd_fn(op), x, sizes, *ws) if kernel == "gate_up" else None
          text = f"fwd {tf * 1e3:.3f} ms, " if tf else ""
          log(f"  sweep {kernel} {t}: {text}fwd+bwd {tb * 1e3:.3f} ms")
          sweep_lines.append(f"| {g} | {r} | {kernel} | {t} | {'-' if tf is None else f'{tf * 1e3:.3f}'} | "
                             f"{tb * 1e3:.3f} |")
    del want
  out = lines + ["", "Speed-up of fused over unfused (time unfused / fused):", "",
                 "| G | R | L | F | fwd | fwd+bwd |", "|---|---|---|---|---|---|", *ratios]
  if sweep_lines:
    out += ["", "Tile sweep, one fused kernel's tile changed from the default at a time (bm, bk, bn, warps, "
            "stages):", "", "| G | R | kernel | tile | fwd ms | fwd+bwd ms |", "|---|---|---|---|---|---|",
            *sweep_lines]
  return out, failures


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--smoke", action="store_true", help="tiny shapes, Pallas interpret mode, CPU; no file")
  p.add_argument("--sweep", action="store_true", help="also vary each fused kernel's tile")
  p.add_argument("--out", default=None, help="markdown file to update (default BENCHMARKS.md on GPU)")
  args = p.parse_args()
  if args.smoke:
    jax.config.update("jax_platforms", "cpu")
  date = subprocess.run(["date", "-u"], capture_output=True, text=True).stdout.strip()
  lines, failures = run(args)
  dev = jax.devices()[0]
  header = [f"`{' '.join(['python3', *sys.argv])}` on {dev.device_kind} ({dev.platform}), "
            f"jax {jax.__version__}, {date}. bf16 inputs and outputs, float32 accumulation; group sizes "
            "Zipf-skewed (exponent 1, seeded, every 16th group empty), summing to R. FLOPs: 3 x 2RLF "
            "forward, 3x that for forward + backward. rel err: against the unfused path in float32.", ""]
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
