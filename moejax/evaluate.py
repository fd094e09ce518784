"""Evaluations of a trained run, on the command line: a table, then the result as JSON on the last line.

python -m moejax.evaluate --workdir runs/tiny --task ppl [--lengths 128,512] [--limit 16]
python -m moejax.evaluate --workdir runs/tiny --task passkey [--lengths 1024,4096] [--depths 0,0.5,1]
python -m moejax.evaluate --workdir runs/mqar_tiny --task mqar [--lengths 256,1024,4096,16384]
python -m moejax.evaluate --workdir runs/vision_tiny --task captions [--limit 100] [--output records.jsonl]

ppl: validation loss overall and by position bucket, on validation documents of at least L + 1 tokens
(moejax.evaluation.perplexity). passkey: a number hidden at depths of a filler text, answered greedily;
accuracy per length and depth (moejax.evaluation.passkey). mqar: multi-query associative recall
accuracy per length, for a run trained on data.source "mqar" (moejax.evaluation.recall). All three feed
long inputs through the prefill path in pieces of inference.prefill_chunk tokens (--piece), so a long row
needs the memory of a piece and the caches. --lengths defaults to 1x, 4x and 16x the longest trained
sequence. captions: greedy captions of the held-out digits and drawn scenes (moejax.vision.captions),
scored by what each must state: {"digits_accuracy": ..., "shapes_accuracy": ...}.
"""

import argparse
import json
import sys

from moejax.device_memory import use_default_memory_fraction

TASKS = ("ppl", "passkey", "mqar", "captions")
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def _ints(text: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
  return values


def _fractions(text: str) -> list[float]:
  try:
    values = [float(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1], got {text!r}") from None
  if not values or not all(0.0 <= v <= 1.0 for v in values):
    raise argparse.ArgumentTypeError(f"expected numbers in [0, 1], got {text!r}")
  return values


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m moejax.evaluate", description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True, help="a training run's workdir (relative or absolute)")
  p.add_argument("--task", required=True, choices=TASKS)
  p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
  p.add_argument("--lengths", type=_ints, default=None,
                 help="comma-separated lengths in tokens (ppl, passkey, mqar; default 1x, 4x, 16x the "
                      "trained length)")
  p.add_argument("--depths", type=_fractions, default=list(DEFAULT_DEPTHS),
                 help="passkey: where the key sits, as fractions of the filler")
  p.add_argument("--trials", type=int, default=2, help="passkey: keys asked per length and depth")
  p.add_argument("--examples", type=int, default=64, help="mqar: rows per length")
  p.add_argument("--piece", type=int, default=None,
                 help="tokens fed per prefill call (default inference.prefill_chunk)")
  p.add_argument("--limit", type=int, default=None,
                 help="captions: examples of each kind; ppl: documents per length (default 16)")
  p.add_argument("--batch", type=int, default=None, help="rows run together (default: 64 for captions, 8 "
                 "for ppl, 16 for mqar, 4 for passkey)")
  p.add_argument("--output", default=None, help="captions: JSONL of every example's record (default: none)")
  return p


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  for name in ("limit", "batch", "piece"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      raise SystemExit(f"--{name} must be >= 1")
  for name in ("trials", "examples"):
    if getattr(args, name) < 1:
      raise SystemExit(f"--{name} must be >= 1")
  if args.task == "captions":
    return _captions(args)
  if args.output is not None:
    raise SystemExit(f"--output is for the captions task; {args.task}'s result is the JSON of the last line")
  from moejax.inference import load_model  # after the memory setting
  from moejax.inference.loading import read_config

  config = read_config(args.workdir)
  lengths = args.lengths or [n * max(int(s[0]) for s in config.train.stages) for n in (1, 4, 16)]
  # Room for the longest row (and a passkey's answer after it); the caches are sized per call.
  lm = load_model(args.workdir, args.step, cache_len=max(lengths) + 64)
  result = {"step": lm.step, "task": args.task}
  if args.task == "ppl":
    result["lengths"] = _ppl(lm, lengths, args)
  elif args.task == "mqar":
    result["lengths"] = _mqar(lm, lengths, args)
  else:
    result.update(_passkey(lm, lengths, args))
  print(json.dumps(result))
  return 0


def _ppl(lm, lengths, args) -> list[dict]:
  from moejax.evaluation.perplexity import loss_by_position, validation_documents

  out = []
  for length in lengths:
    docs = validation_documents(lm.config, length + 1, args.limit or 16)
    if not docs:
      print(f"length {length}: no validation document has {length + 1} tokens; skipped")
      out.append({"length": length, "documents": 0, "tokens": 0, "loss": None, "buckets": []})
      continue
    r = loss_by_position(lm, docs, length, batch=args.batch or 8, piece=args.piece)
    print(f"length {length}: loss {r['loss']:.4f} over {r['documents']} documents")
    for b in r["buckets"]:
      print(f"  positions [{b['start']:>7}, {b['end']:>7}): loss {b['loss']:.4f}  ({b['tokens']} tokens)")
    out.append(r)
  return out


def _mqar(lm, lengths, args) -> list[dict]:
  from moejax.evaluation.recall import mqar_accuracy

  out = []
  print(f"{'length':>8} {'examples':>8} {'queries':>8} {'accuracy':>8}")
  for length in lengths:
    r = mqar_accuracy(lm, length, examples=args.examples, batch=args.batch or 16, piece=args.piece)
    print(f"{length:>8} {r['examples']:>8} {r['queries']:>8} {r['accuracy']:>8.3f}")
    out.append(r)
  return out


def _passkey(lm, lengths, args) -> dict:
  from moejax.evaluation.passkey import passkey_accuracy

  r = passkey_accuracy(lm, lengths, args.depths, trials=args.trials, batch=args.batch or 4)
  print(f"{'length':>8} " + " ".join(f"{d:>6.2f}" for d in args.depths) + "   all")
  for row in r["lengths"]:
    print(f"{row['length']:>8} " + " ".join(f"{d['accuracy']:>6.2f}" for d in row["depths"])
          + f"  {row['accuracy']:.2f}")
  return r


def _captions(args) -> int:
  from moejax.inference import load_model  # after the memory setting
  from moejax.vision.captions import caption_accuracy, held_out_examples

  lm = load_model(args.workdir, args.step)
  if not lm.config.model.vision.enabled:
    raise SystemExit(f"{args.workdir}: the captions task needs a model with a vision tower "
                     "(model.vision.enabled)")
  summary, records = caption_accuracy(lm, held_out_examples(lm.config, args.limit), batch=args.batch or 64)
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
  try:
    sys.exit(main())
  except (ValueError, FileNotFoundError) as e:  # what the run cannot do: its reason, without a traceback
    sys.exit(f"python -m moejax.evaluate: {e}")
