"""Registers and spills of the KDA kernels as ptxas builds them for an H200, on a machine without one.

Compiles `chunk_kda(implementation="pallas")` forward and backward for the deviceless H200 of
tools/deviceless.py (which says how to install the CUDA plugin it needs) and prints, per kernel,
ptxas's register count, its spill bytes and how many warps an SM can then hold. A register-bound kernel
holds few warps (255 registers: 8 of 64), so it has little to hide its latencies with; that is what to
look at before timing a launch setting or a rewrite on the GPU. No timing here.

  JAX_PLATFORMS=cpu /tmp/gpuvenv/bin/python -m tools.kda_registers --prep-fwd 128,4 64,2 32,4 \\
      --prep-bwd 32,2 32,8

Each setting (BLOCK,WARPS of one kernel, the others at the defaults) is one compile of the op's forward
and backward, about 30 s on two CPU cores. With --forward-only, the forward alone (at B=1 T=32768 H=16
by default, where its state pass segments and a correction kernel follows).
"""

import argparse
import collections
import sys

from benchmarks.report import replace_section
from tools import deviceless

# Setting name -> (Config block field, Config tuning field).
KNOBS = {"prep_fwd": ("block_fwd", "prep_fwd"), "prep_bwd": ("block", "prep_bwd"),
         "state_grads": ("block_grads", "state_grads")}


def block_warps(config) -> collections.defaultdict:
  """{kernel name: warps per block}: the Triton kernels' launch settings at chunk 32 (Config.for_chunk),
  and one warpgroup for the Mosaic GPU scans (mosaic.common.launch)."""
  c = config.for_chunk(32)
  out = collections.defaultdict(lambda: 4)  # the Mosaic scans' one warpgroup
  out.update(kda_prep_fwd=c.prep_fwd.num_warps, kda_prep_bwd=c.prep_bwd.num_warps,
             kda_state_grads=c.state_grads.num_warps, kda_scan_fwd=c.scan_fwd.num_warps,
             kda_scan_bwd=c.scan_bwd.num_warps)
  return out


def compile_op(config, shape: tuple[int, int, int], gates: str, chunk: int,
               forward_only: bool = False) -> None:
  """Compiles the op's forward and backward (q, k, v, g, beta cotangents) for the deviceless H200, or
  with forward_only its forward alone (which, with few rows x heads, walks its state pass in segments)."""
  import jax
  import jax.numpy as jnp

  from pallas_kernels.kda.ops import chunk_kda_pallas

  B, T, H = shape
  D = 128
  sharding = deviceless.h200_sharding()
  arg = lambda s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=sharding)
  args = (arg((B, T, H, D)), arg((B, T, H, D)), arg((B, T, H, D)), arg((B, T, H, D), jnp.dtype(gates)),
          arg((B, T, H)))

  def loss(q, k, v, g, beta):
    o, _ = chunk_kda_pallas(q, k, v, g, beta, D ** -0.5, None, None, chunk_size=chunk,
                            output_final_state=False, interpret=False, config=config)
    return jnp.sum(o.astype(jnp.float32))

  fn = loss if forward_only else jax.grad(loss, argnums=(0, 1, 2, 3, 4))
  with deviceless.gpu_default_backend(), jax.set_mesh(sharding.mesh):
    jax.jit(fn).trace(*args).lower().compile()


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  pair = lambda s: tuple(int(x) for x in s.split(","))
  for knob in KNOBS:
    p.add_argument(f"--{knob.replace('_', '-')}", type=pair, nargs="*", default=[], metavar="BLOCK,WARPS",
                   help=f"{knob} settings to compile (the others at their defaults)")
  p.add_argument("--shape", type=lambda s: tuple(int(x) for x in s.split("x")), default=None,
                 help="BxTxH (K = V = 128); default 2x8192x16, with --forward-only 1x32768x16")
  p.add_argument("--forward-only", action="store_true",
                 help="compile the forward alone (inference's path: the segmented state pass at B=1)")
  p.add_argument("--gates", default="bfloat16", help="dtype of g (the model's KDA layers pass float32)")
  p.add_argument("--chunk", type=int, default=32)
  p.add_argument("--out", help="also write the table into this markdown file's section")
  args = p.parse_args(argv)
  args.shape = args.shape or ((1, 32768, 16) if args.forward_only else (2, 8192, 16))
  log = deviceless.verbose_ptxas()

  from pallas_kernels.kda.config import Config
  from pallas_kernels.kda.lowering import Tuning

  runs = [("defaults", Config(), "kda_")]  # every KDA kernel; then only the one a setting changes
  for knob, (block_field, tuning_field) in KNOBS.items():
    for block, warps in getattr(args, knob):
      runs.append((f"{knob} block={block} warps={warps}",
                   Config(**{block_field: block, tuning_field: Tuning(warps, 1)}), f"kda_{knob}"))
  lines = ["| setting | kernel | registers | spill stores / loads (bytes) | warps per block | "
           "warps per SM (registers) |", "|---|---|---|---|---|---|"]
  for name, config, prefix in runs:
    start = log.stat().st_size
    compile_op(config, args.shape, args.gates, args.chunk, args.forward_only)
    with log.open() as f:
      f.seek(start)
      kernels = deviceless.ptxas_kernels(f.read())
    warps = block_warps(config)
    rows = [f"| {name} | {kernel} | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} | "
            f"{warps[kernel]} | {deviceless.warps_per_sm(r['registers'], warps[kernel])} |"
            for kernel, r in sorted(kernels.items()) if kernel.startswith(prefix)]
    if not rows:
      raise SystemExit(f"no ptxas report of a KDA kernel in {log} for {name}")
    lines += rows
    print("\n".join(rows), flush=True)
  B, T, H = args.shape
  what = "forward alone" if args.forward_only else "forward + backward"
  body = [f"ptxas for sm_90a (deviceless H200), chunk_kda {what} at B={B} T={T} H={H} "
          f"K=V=128, bf16 q/k/v, {args.gates} gates, chunk {args.chunk}. Command: "
          f"`{' '.join(['python'] + sys.argv)}`", "",
          *lines]
  print("\n".join(body))
  if args.out:
    title = "KDA kernels' registers, forward alone" if args.forward_only else "KDA kernels' registers"
    replace_section(args.out, f"{title} (ptxas, no GPU)", "\n".join(body), level=3)


if __name__ == "__main__":
  main()
