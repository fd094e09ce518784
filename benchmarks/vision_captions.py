"""Captioning accuracy of experiments/vision_tiny.py trained from scratch on the CPU, and the run's time.

python -m benchmarks.vision_captions [--workdir runs/vision_tiny_bench] [--out BENCHMARKS.md] [overrides...]

Runs `python -m moejax.train --config experiments/vision_tiny.py` in a fresh workdir (data preparation
included: the whole run as a new user times it), then `python -m moejax.evaluate --task captions` over
every held-out digit and scene, and writes the "Vision (experiments/vision_tiny.py)" section: accuracy on
each kind, the per-attribute accuracy of the scenes, and the minutes of each part. Target: digits at least
0.90 and shapes at least 0.80, trained within 15 minutes on a 2-core CPU.
"""

import argparse
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

from benchmarks.report import provenance, publish
from moejax.vision.scenes import COLOURS, COUNTS, POSITIONS, SHAPES, scene_caption_correct

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "experiments" / "vision_tiny.py"


def attribute_accuracy(records: list[dict]) -> dict[str, float]:
  """Per scene attribute, the share of held-out scene captions right about it: those that some label with
  the true value of that attribute (and any values of the others) accepts as right."""
  scenes = [r for r in records if r["kind"] == "scenes"]
  values = {"shape": SHAPES, "colour": tuple(COLOURS), "count": COUNTS, "position": POSITIONS}
  out = {}
  for name in values:
    others = [n for n in values if n != name]
    right = 0
    for r in scenes:
      labels = ({name: r["label"][name], **dict(zip(others, combo, strict=True))}
                for combo in itertools.product(*(values[n] for n in others)))
      right += any(scene_caption_correct(r["caption"], label) for label in labels)
    out[name] = right / max(len(scenes), 1)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="runs/vision_tiny_bench")
  parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
  parser.add_argument("overrides", nargs="*", help="--config.X=value flags for the training run")
  args = parser.parse_args()
  if os.path.exists(args.workdir):
    shutil.rmtree(args.workdir)  # from scratch: the time is that of a whole run
  start = time.perf_counter()
  subprocess.run([sys.executable, "-m", "moejax.train", "--config", str(CONFIG), "--workdir", args.workdir,
                  *args.overrides], check=True)
  trained = time.perf_counter()
  records_path = os.path.join(args.workdir, "captions.jsonl")
  out = subprocess.run([sys.executable, "-m", "moejax.evaluate", "--workdir", args.workdir, "--task",
                        "captions", "--output", records_path], check=True, capture_output=True, text=True)
  evaluated = time.perf_counter()
  print(out.stderr[-2000:])
  result = json.loads(out.stdout.strip().splitlines()[-1])
  with open(records_path) as f:
    records = [json.loads(line) for line in f]
  per_attribute = attribute_accuracy(records)
  train_min, eval_min = (trained - start) / 60, (evaluated - trained) / 60
  met = result["digits_accuracy"] >= 0.90 and result["shapes_accuracy"] >= 0.80 and train_min <= 15
  of = lambda kind, n: [r for r in records if r["kind"] == kind][:n]
  examples = of("digits", 2) + of("scenes", 3)
  lines = provenance(f"CPU ({os.cpu_count()} cores)") + [
      f"`experiments/vision_tiny.py` from scratch (step {result['step']}), then greedy captions of every "
      f"held-out image: {result['digits']} digits (scikit-learn's scans, the 15% held out by index hash) and "
      f"{result['scenes']} drawn scenes (their own seed stream).", "",
      "| | accuracy |", "|---|---|",
      f"| digits (names the right digit) | {result['digits_accuracy']:.3f} |",
      f"| shapes (every attribute right) | {result['shapes_accuracy']:.3f} |"]
  lines += [f"| scenes: {name} right | {acc:.3f} |" for name, acc in per_attribute.items()]
  lines += ["", f"Training {train_min:.1f} min (data preparation and compiles included), captioning "
            f"{eval_min:.1f} min. Target (digits >= 0.90, shapes >= 0.80, training <= 15 min on 2 cores): "
            f"{'met' if met else 'NOT met'}.", "", "Held-out captions:", ""]
  lines += [f"- {r['kind']} {r['label']}: \"{r['caption']}\" ({'right' if r['right'] else 'wrong'})"
            for r in examples]
  publish(args.out, "Vision (experiments/vision_tiny.py)", lines)


if __name__ == "__main__":
  main()
