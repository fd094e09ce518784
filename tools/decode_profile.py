"""Where a decode step's time goes: kernels launched per step, the device's busy time against the wall
time, and the model parts that own the kernels (tools/trace_parts.py), for one batch and context.

python -m tools.decode_profile [--config experiments/h200.py] [--batch 1] [--context 4096]

The decode loop (`Engine.decode`) runs its steps in a `lax.while_loop` on the device. When a step's
wall time is far above its kernels' summed time, the step is bound by launching kernels, not by moving
bytes: the remedy is fewer kernels (fusion, a decode kernel) or a loop XLA runs as one CUDA graph
(run it again with XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" to see).
"""

import argparse
import os
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp

from benchmarks.generate import DECODE_STEPS, filled_rows
from benchmarks.step import XLA_FLAGS
from moejax.config import load_experiment, validate
from moejax.inference import random_model
from moejax.inference.sampling import Sampling
from tools.trace_parts import kernel_events, load_trace, main_module_events, op_names, table

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=str(ROOT / "experiments" / "h200.py"))
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--context", type=int, default=4096)
  parser.add_argument("--calls", type=int, default=3, help="timed and traced calls of DECODE_STEPS steps")
  parser.add_argument("--smoke", action="store_true", help="experiments/tiny.py at small sizes (CPU)")
  args = parser.parse_args()
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), XLA_FLAGS])
  if args.smoke:
    args.config, args.context = str(ROOT / "experiments" / "tiny.py"), min(args.context, 128)
  config = validate(load_experiment(args.config))
  room = DECODE_STEPS * (2 * args.calls + 2)
  lm = random_model(config, cache_len=args.context + room)
  rows = filled_rows(lm, args.batch, args.context, room=room)
  keys = jax.random.split(jax.random.key(0), args.batch)
  sampling = Sampling()
  hlo = lm.engine._decode.lower(lm.variables, rows, keys, jnp.int32(-1), DECODE_STEPS,
                                sampling).compile().as_text()
  rows, *_ = lm.engine.decode(rows, keys, -1, DECODE_STEPS, sampling)
  jax.block_until_ready(rows.logits_BV)
  t0 = time.perf_counter()
  for _ in range(args.calls):
    rows, tokens, _, _ = lm.engine.decode(rows, keys, -1, DECODE_STEPS, sampling)
  jax.block_until_ready(tokens)
  wall_ms = (time.perf_counter() - t0) * 1e3 / args.calls
  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
      for _ in range(args.calls):
        rows, tokens, _, _ = lm.engine.decode(rows, keys, -1, DECODE_STEPS, sampling)
      jax.block_until_ready(tokens)
    events = main_module_events(kernel_events(load_trace(log_dir)))
  steps = args.calls * DECODE_STEPS
  busy_ms = sum(e[3] for e in events) / 1e3 / steps
  print(f"{jax.devices()[0].device_kind}, {pathlib.Path(args.config).name}, batch {args.batch}, context "
        f"{args.context:,}, XLA_FLAGS={os.environ['XLA_FLAGS']!r}")
  print(f"per decode step: {len(events) / steps:.0f} kernels, {busy_ms:.3f} ms of kernel time, "
        f"{wall_ms / DECODE_STEPS:.3f} ms of wall time (untraced), "
        f"{(wall_ms / DECODE_STEPS - busy_ms) * 1e3 / max(len(events) / steps, 1):.1f} us idle per kernel")
  print("\n".join(table(events, op_names(hlo), calls=steps, wall_ms=wall_ms / DECODE_STEPS, top=25)))


if __name__ == "__main__":
  main()
