"""Evaluations of a trained run, on the command line; the last line printed is the result as JSON.

python -m moejax.evaluate --workdir runs/vision_tiny --task captions [--limit 100] [--output records.jsonl]

captions: greedy captions of the held-out digits and drawn scenes (moejax.vision.captions), scored by
what each must state: {"digits_accuracy": ..., "shapes_accuracy": ...}.
"""

import argparse
import json
import sys

from moejax.device_memory import use_default_memory_fraction

TASKS = ("captions",)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m moejax.evaluate", description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True, help="a training run's workdir (relative or absolute)")
  p.add_argument("--task", required=True, choices=TASKS)
  p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
  p.add_argument("--limit", type=int, default=None, help="at most this many examples of each kind")
  p.add_argument("--batch", type=int, default=64, help="rows generated together")
  p.add_argument("--output", default=None, help="JSONL of every example's record (default: none)")
  return p


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.limit is not None and args.limit < 1:
    raise SystemExit("--limit must be >= 1")
  from moejax.inference import load_model  # after the memory setting
  from moejax.vision.captions import caption_accuracy, held_out_examples

  lm = load_model(args.workdir, args.step)
  if not lm.config.model.vision.enabled:
    raise SystemExit(f"{args.workdir}: the captions task needs a model with a vision tower "
                     "(model.vision.enabled)")
  summary, records = caption_accuracy(lm, held_out_examples(lm.config, args.limit), batch=args.batch)
  if args.output:
    with open(args.output, "w") as f:
      for r in records:
        f.write(json.dumps(r) + "\n")
  for r in records[:3] + [r for r in records if r["kind"] == "scenes"][:3]:
    print(f"{r['kind']}: {r['label']} -> {r['caption']!r} ({'right' if r['right'] else 'wrong'})",
          file=sys.stderr)
  print(json.dumps({"step": lm.step, **summary}))
  return 0


if __name__ == "__main__":
  use_default_memory_fraction()
  sys.exit(main())
