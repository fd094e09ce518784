"""Expert balance of each balancing mode, side by side, on one small MoE LM (CPU is fine).

python -m benchmarks.balance [--steps 300] [--out BENCHMARKS.md]
python -m benchmarks.balance --gpu ...     (experiments/h200.py at scale: benchmarks/balance_gpu.py)

Trains the same model on the same data stream once per mode of `model.moe.balance` (quantile, sign,
aux, none, and "smoothed": quantile with model.moe.quantile_smoothing) and reports MaxVio_batch (the
mean over the MoE layers, averaged over the second half of training, and the worst layer's median
there), MaxVio_global (from the loads accumulated over the whole run) and the final training and
validation loss. The table
replaces the "## Expert balance" section of BENCHMARKS.md.
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

import numpy as np

from benchmarks import balance_gpu
from benchmarks.report import commit, replace_section
from moejax.config import base_config
from moejax.train import run

MODES = ("quantile", "smoothed", "sign", "aux", "none")


def bench_config(mode: str, steps: int, cache_dir: str):
  c = base_config()
  c.data.vocab_size = 1024
  c.data.cache_dir = cache_dir
  m = c.model
  m.d_model = 64
  m.num_layers = 4
  m.layer_pattern = "KKKM"
  m.num_dense_layers = 1
  m.moe.num_experts = 32
  m.moe.top_k = 4
  m.moe.latent_dim = 32
  m.moe.expert_hidden_dim = 32
  m.moe.balance = "quantile" if mode == "smoothed" else mode
  if mode == "smoothed":
    m.moe.quantile_smoothing = balance_gpu.SMOOTHING
  c.train.stages = ((128, steps, 1024),)
  c.train.eval_every = steps
  c.train.checkpoint_every = steps
  c.train.progress_bar = False
  return c


def summarise(rows: list[dict]) -> dict:
  train = [r for r in rows if "loss" in r]
  second_half = train[len(train) // 2:]
  val = [r["val_loss"] for r in rows if "val_loss" in r]
  return {
      "maxvio_batch": float(np.mean([r["moe/maxvio_batch"] for r in second_half])),
      "worst_median": balance_gpu.worst_layer_median(second_half, second_half[0]["step"],
                                                     second_half[-1]["step"]),
      "maxvio_global": train[-1]["moe/maxvio_global"],
      "loss": float(np.mean([r["loss"] for r in train[-10:]])),
      "val_loss": val[-1] if val else float("nan"),
  }


def _names(text: str, choices) -> list[str]:
  names = [v for v in text.split(",") if v]
  if not names or any(v not in choices for v in names):
    raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated names of {', '.join(choices)}")
  return names


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=None, help="steps per run (300; 1000 with --gpu)")
  parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent.parent / "BENCHMARKS.md"))
  scale = parser.add_argument_group("--gpu: experiments/h200.py's model at scale (benchmarks/balance_gpu.py)")
  scale.add_argument("--gpu", action="store_true")
  names = lambda choices: lambda text: _names(text, choices)
  scale.add_argument("--shapes", type=names(balance_gpu.SHAPES), default=["h200"],
                     help=f"comma-separated, of {','.join(balance_gpu.SHAPES)}")
  scale.add_argument("--modes", type=names(balance_gpu.MODES), default=["quantile", "frozen", "sign", "aux"],
                     help=f"comma-separated, of {','.join(balance_gpu.MODES)}")
  scale.add_argument("--workdir", default="runs/balance", help="the runs, resumed from here")
  scale.add_argument("--time-limit-s", type=float, default=540.0,
                     help="this call stops its runs near this many seconds (they resume next call)")
  scale.add_argument("--frozen-steps", type=int, default=balance_gpu.FROZEN_STEPS,
                     help="steps of the 'frozen' mode past the quantile run's end")
  scale.add_argument("--min-run-s", type=float, default=120.0,
                     help="no run starts with less time left than this")
  scale.add_argument("--figure", default=None, help="the PNG's path (benchmarks/figures/balance_gpu.png)")
  scale.add_argument("--json", default=None, help="also write the figures here")
  scale.add_argument("--smoke", action="store_true", help="experiments/tiny.py on the CPU; writes no table")
  args = parser.parse_args()
  if args.gpu:
    args.steps = args.steps or 1000
    args.argv = sys.argv[1:]
    args.argv.remove("--gpu")
    balance_gpu.main(args)
    return
  args.steps = args.steps or 300

  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    for mode in MODES:
      workdir = os.path.join(tmp, mode)
      t0 = time.perf_counter()
      run(bench_config(mode, args.steps, os.path.join(tmp, "data")), workdir)
      rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
      results[mode] = {**summarise(rows), "seconds": time.perf_counter() - t0}
      print(mode, json.dumps(results[mode]), flush=True)

  ref = results["none"]["maxvio_batch"]
  lines = ["| balance | MaxVio_batch (2nd half mean) | worst layer's MaxVio_batch (2nd half median) "
           "| MaxVio_global | vs none (batch) | train loss (last 10) | val loss | wall s |",
           "|---|---|---|---|---|---|---|---|"]
  for mode, r in results.items():
    lines.append(f"| {mode} | {r['maxvio_batch']:.3f} | {r['worst_median']:.3f} | {r['maxvio_global']:.3f} | "
                 f"{r['maxvio_batch'] / ref:.2f}x | {r['loss']:.3f} | {r['val_loss']:.3f} "
                 f"| {r['seconds']:.0f} |")
  table = "\n".join(lines)
  print(table)
  command = "python -m benchmarks.balance " + " ".join(sys.argv[1:])
  now = datetime.datetime.now(datetime.UTC)
  body = (f"Command: `{command.strip()}`  \nDate: {now:%Y-%m-%d %H:%M} UTC  \n"
          f"Device: CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)  \n"
          f"Model: d_model 64, 4 layers (KKKM, layer 0 dense), 32 routed experts top-4, 1 shared; "
          f"{args.steps} steps of 1024 tokens (seq 128) on the embedded stdlib corpus; the same data "
          f"stream for every mode. 'smoothed' is quantile with model.moe.quantile_smoothing="
          f"{balance_gpu.SMOOTHING}. Commit: {commit()}.\n\n{table}\n")
  replace_section(args.out, "Expert balance", body)


if __name__ == "__main__":
  main()
